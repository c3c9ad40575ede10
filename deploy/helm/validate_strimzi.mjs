// Strimzi resources (a JSON list on stdin) against the validators @kubernetes-models/strimzi-kafka-operator compiles
// from Strimzi's own CRDs; run by deploy/helm/validate.py from the npm folder that package is installed in.
import { readFileSync } from "node:fs";

const docs = JSON.parse(readFileSync(0, "utf8"));
let bad = 0;
for (const doc of docs) {
  const version = doc.apiVersion.split("/")[1];
  const where = `${doc.kind} ${doc.metadata?.name}`;
  let model;
  try {
    model = await import(`@kubernetes-models/strimzi-kafka-operator/kafka.strimzi.io/${version}/${doc.kind}`);
  } catch (err) {
    console.log(`UNCHECKED ${where}: no model for ${doc.apiVersion} ${doc.kind}`);
    bad++;
    continue;
  }
  try {
    new model[doc.kind](doc).validate();
  } catch (err) {
    console.log(`INVALID ${where}: ${err.message}`);
    bad++;
  }
}
process.exit(bad ? 1 : 0);
