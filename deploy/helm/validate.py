"""Validate rendered manifests offline: Kubernetes' own kinds against Kubernetes' schemas (kubernetes-validate, strict:
an unknown field is an error), custom resources against their CRDs' schemas (KEDA's and prometheus-operator's CRD
files from their Go modules, made strict the same way; Strimzi's through the validators that
@kubernetes-models/strimzi-kafka-operator compiles from Strimzi's CRDs, run by node). A resource of any other
group fails: nothing passes unchecked. Run by .ci/helm.

usage: python deploy/helm/validate.py --kube-version 1.34.0 --crds CRD.yaml [--crds ...] [--strimzi DIR] FILE...
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

#: API groups whose kinds kubernetes-validate knows (the core group has none).
CORE_GROUPS = {"", "apps", "batch", "policy", "autoscaling", "networking.k8s.io", "rbac.authorization.k8s.io",
               "storage.k8s.io", "scheduling.k8s.io", "coordination.k8s.io", "discovery.k8s.io"}


def strict(schema: dict) -> dict:
    """The CRD schema with additionalProperties false wherever it lists properties and keeps no unknown fields: the
    API server would prune (drop) an unknown field silently; here it is an error."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def crd_schemas(paths: list[Path]) -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the strict openAPIV3Schema of each CRD file given (or each in a folder given)."""
    out = {}
    for given in paths:
        for path in sorted(given.glob("*.yaml")) if given.is_dir() else [given]:
            for doc in yaml.safe_load_all(path.read_text()):
                if not doc or doc.get("kind") != "CustomResourceDefinition":
                    continue
                spec = doc["spec"]
                for version in spec["versions"]:
                    schema = strict(version["schema"]["openAPIV3Schema"])
                    # metadata is the API server's ObjectMeta, which the CRD leaves open.
                    schema.get("properties", {})["metadata"] = {"type": "object"}
                    out[(f"{spec['group']}/{version['name']}", spec["names"]["kind"])] = schema
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kube-version", required=True)
    parser.add_argument("--crds", type=Path, action="append", default=[], help="a CRD yaml file, or a folder of them")
    parser.add_argument("--strimzi", type=Path, help="an npm folder with @kubernetes-models/strimzi-kafka-operator "
                                                     "and validate_strimzi.mjs")
    parser.add_argument("files", type=Path, nargs="+")
    args = parser.parse_args()
    schemas = crd_schemas(args.crds)
    failed = 0
    for path in args.files:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        counts: Counter = Counter()
        strimzi = []
        for doc in docs:
            api, kind = doc.get("apiVersion", ""), doc.get("kind", "")
            where = f"{path.name}: {kind} {doc.get('metadata', {}).get('name', '?')}"
            group = api.rsplit("/", 1)[0] if "/" in api else ""
            try:
                if group in CORE_GROUPS:
                    kubernetes_validate.validate(doc, args.kube_version, strict=True)
                    counts["kubernetes"] += 1
                elif group == "kafka.strimzi.io" and args.strimzi:
                    strimzi.append(doc)
                elif (api, kind) in schemas:
                    jsonschema.validate(doc, schemas[(api, kind)])
                    counts[group] += 1
                else:
                    raise LookupError(f"no schema for {api} {kind} (give its CRDs with --crds)")
            except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as exc:
                print(f"INVALID {where}: {exc.message} at {'/'.join(map(str, exc.path))}")
                failed += 1
            except (LookupError, kubernetes_validate.SchemaNotFoundError) as exc:
                print(f"UNCHECKED {where}: {exc}")
                failed += 1
        if strimzi:
            done = subprocess.run(["node", str(args.strimzi / "validate_strimzi.mjs")], input=json.dumps(strimzi),
                                  capture_output=True, text=True, cwd=args.strimzi)
            print(done.stdout, end="")
            if done.returncode:
                print(done.stderr, end="")
                failed += 1
            else:
                counts["kafka.strimzi.io"] += len(strimzi)
        print(f"{path.name}: {sum(counts.values())} of {len(docs)} resources valid "
              f"({', '.join(f'{k} {n}' for k, n in sorted(counts.items()))})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
