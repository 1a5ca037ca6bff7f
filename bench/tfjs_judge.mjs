// The TensorFlow.js judge: load a Layers model.json with TF.js itself (pure JavaScript CPU backend,
// through an fs IO handler: @tensorflow/tfjs has no file:// loader without tfjs-node), run it on the
// inputs of a JSON file and print {"version", "outputs": [...], "shape": [...]} as JSON.
//
//   TFJS_MODULES=/work/tfjs-judge/node_modules node bench/tfjs_judge.mjs DIR/model.json inputs.json
// (TFJS_MODULES: the node_modules of `npm install @tensorflow/tfjs@4.22.0`, kept out of the repository)
//
// inputs.json: {"shape": [N, ...], "data": [flat float32 values]} (channels_last, as Keras takes them), or a
// list of {"shape", "dtype", "data"} (a model of several inputs): then {"version", "results": [{"shape", "outputs"},
// ...]}, one per output.
import { readFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { createRequire } from "node:module";

const require = createRequire(process.env.TFJS_MODULES ? join(process.env.TFJS_MODULES, "x.js") : import.meta.url);
const tf = require("@tensorflow/tfjs");

const [modelPath, inputsPath] = process.argv.slice(2);
const folder = dirname(modelPath);
const handler = {
  async load() {
    const json = JSON.parse(readFileSync(modelPath, "utf8"));
    const specs = [];
    const buffers = [];
    for (const group of json.weightsManifest) {
      specs.push(...group.weights);
      for (const p of group.paths) {
        const b = readFileSync(join(folder, p));
        buffers.push(b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength));
      }
    }
    return {
      modelTopology: json.modelTopology, format: json.format, generatedBy: json.generatedBy,
      convertedBy: json.convertedBy, userDefinedMetadata: json.userDefinedMetadata,
      weightSpecs: specs, weightData: tf.io.concatenateArrayBuffers(buffers),
    };
  },
};
await tf.setBackend("cpu");
const model = await tf.loadLayersModel(handler, { strict: true });
const inputs = JSON.parse(readFileSync(inputsPath, "utf8"));
const tensor = (i) => tf.tensor(i.data, i.shape, i.dtype || "float32");
if (Array.isArray(inputs)) {          // several inputs (a list of {shape, dtype, data}): every output, in order
  const ys = [model.predict(inputs.length === 1 ? tensor(inputs[0]) : inputs.map(tensor))].flat();
  const results = [];
  for (const y of ys) results.push({ shape: y.shape, outputs: Array.from(await y.data()) });
  process.stdout.write(JSON.stringify({ version: tf.version.tfjs, results }) + "\n");
} else {
  const y = model.predict(tensor(inputs));
  process.stdout.write(JSON.stringify({
    version: tf.version.tfjs, shape: y.shape, outputs: Array.from(await y.data()),
    layers: model.layers.map((l) => l.getClassName()),
  }) + "\n");
}
