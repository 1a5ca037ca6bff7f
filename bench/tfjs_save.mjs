// TensorFlow.js writes a Layers model of its own, as tfjs-node's file:// handler lays it out (model.json +
// weights.bin), and prints its predictions: the fixture that modelkit's tfjs reader is judged against.
//
//   TFJS_MODULES=/work/tfjs-judge/node_modules node bench/tfjs_save.mjs OUT_DIR inputs.json
import { mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { createRequire } from "node:module";

const require = createRequire(process.env.TFJS_MODULES ? join(process.env.TFJS_MODULES, "x.js") : import.meta.url);
const tf = require("@tensorflow/tfjs");

const [out, inputsPath] = process.argv.slice(2);
await tf.setBackend("cpu");
const model = tf.sequential({ layers: [
  tf.layers.dense({ inputShape: [4], units: 8, activation: "relu", kernelInitializer: tf.initializers.glorotNormal({ seed: 1 }),
                    biasInitializer: tf.initializers.randomNormal({ seed: 2 }) }),
  tf.layers.dense({ units: 3, activation: "tanh", kernelInitializer: tf.initializers.glorotNormal({ seed: 3 }),
                    biasInitializer: tf.initializers.randomNormal({ seed: 4 }) }),
] });
mkdirSync(out, { recursive: true });
await model.save({
  async save(artifacts) {
    writeFileSync(join(out, "weights.bin"), Buffer.from(artifacts.weightData));
    writeFileSync(join(out, "model.json"), JSON.stringify({
      modelTopology: artifacts.modelTopology, format: artifacts.format, generatedBy: artifacts.generatedBy,
      convertedBy: artifacts.convertedBy, weightsManifest: [{ paths: ["./weights.bin"], weights: artifacts.weightSpecs }],
    }));
    return { modelArtifactsInfo: { dateSaved: new Date(), modelTopologyType: "JSON" } };
  },
});
const inputs = JSON.parse(readFileSync(inputsPath, "utf8"));
const y = model.predict(tf.tensor(inputs.data, inputs.shape));
process.stdout.write(JSON.stringify({ version: tf.version.tfjs, shape: y.shape, outputs: Array.from(await y.data()) }) + "\n");
