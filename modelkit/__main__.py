"""`python -m modelkit` runs the CLI (and is what `torchrun -m modelkit` starts on each rank)."""
from modelkit.cli import main

if __name__ == "__main__":
    main()
