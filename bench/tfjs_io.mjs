// What the TF.js scripts share: TensorFlow.js itself (from TFJS_MODULES, the node_modules of
// `npm install @tensorflow/tfjs@4.22.0`, kept out of the repository) and saving a Layers model as tfjs-node's
// file:// handler lays it out (model.json with path ./weights.bin, and weights.bin).
import { mkdirSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { createRequire } from "node:module";

const require = createRequire(process.env.TFJS_MODULES ? join(process.env.TFJS_MODULES, "x.js") : import.meta.url);
export const tf = require("@tensorflow/tfjs");

export async function saveLayersModel(model, dir) {
  mkdirSync(dir, { recursive: true });
  await model.save({
    async save(artifacts) {
      writeFileSync(join(dir, "weights.bin"), Buffer.from(artifacts.weightData));
      writeFileSync(join(dir, "model.json"), JSON.stringify({
        modelTopology: artifacts.modelTopology, format: artifacts.format, generatedBy: artifacts.generatedBy,
        convertedBy: artifacts.convertedBy, weightsManifest: [{ paths: ["./weights.bin"], weights: artifacts.weightSpecs }],
      }));
      return { modelArtifactsInfo: { dateSaved: new Date(), modelTopologyType: "JSON" } };
    },
  });
}
