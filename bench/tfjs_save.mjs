// TensorFlow.js writes a Layers model of its own, as tfjs-node's file:// handler lays it out (model.json +
// weights.bin), and prints its predictions: the fixture that modelkit's tfjs reader is judged against.
//
//   TFJS_MODULES=/work/tfjs-judge/node_modules node bench/tfjs_save.mjs OUT_DIR inputs.json [small|mlp]
import { readFileSync } from "node:fs";
import { saveLayersModel, tf } from "./tfjs_io.mjs";

const [out, inputsPath, shape = "small"] = process.argv.slice(2);
await tf.setBackend("cpu");
const dense = (units, activation, seed, extra = {}) => tf.layers.dense({
  units, activation, kernelInitializer: tf.initializers.glorotNormal({ seed }),
  biasInitializer: tf.initializers.randomNormal({ seed: seed + 1 }), ...extra });
const layers = shape === "mlp"
  ? [dense(30, "relu", 1, { inputShape: [2] }), dense(20, "relu", 3), dense(2, "linear", 5)]
  : [dense(8, "relu", 1, { inputShape: [4] }), dense(3, "tanh", 3)];
const model = tf.sequential({ layers });
await saveLayersModel(model, out);
const inputs = JSON.parse(readFileSync(inputsPath, "utf8"));
const y = model.predict(tf.tensor(inputs.data, inputs.shape));
process.stdout.write(JSON.stringify({ version: tf.version.tfjs, shape: y.shape, outputs: Array.from(await y.data()) }) + "\n");
