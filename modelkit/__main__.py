"""`python -m modelkit` runs the CLI (and is what `torchrun -m modelkit` starts on each rank)."""
from modelkit.cli import run

if __name__ == "__main__":
    run()
