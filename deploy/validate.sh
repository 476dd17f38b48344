#!/usr/bin/env bash
# Validates deploy/ without a cluster:
#   1. checks that the kustomize tree (base/, overlays/, components/) is
#      what deploy/generate.py writes from the Helm chart
#      deploy/helm/example-csi, the one source of the manifests, and that
#      kustomize builds what the chart renders for every flavor, alone and
#      with each component,
#   2. lints the YAML sources with yamllint (deploy/.yamllint),
#   3. checks the chart's values with deploy/check_values.py: helm lint
#      --strict, its version equal to the crate's, the defaults and the
#      example classes, non-default values reaching their objects, bad
#      values rejected,
#   4. runs deploy/check_manifests.py on the chart's renderings (those of
#      step 1 and of step 3), each overlay with its images pinned by digest,
#      and the examples: Kubernetes API schemas (kubernetes-validate,
#      strict) for each version in K8S_VERSIONS, deploy/schemas/ for the CRD
#      kinds, security posture, socket/port/flag wiring, RBAC, examples,
#   5. checks that the Dockerfile pins its base images and installs the
#      tools the driver calls.
# It installs what it needs (pip packages, kustomize and helm with
# `go install`) the first time, and reuses them afterwards.
#
# Environment:
#   K8S_VERSIONS     Kubernetes versions to validate against (default "1.35 1.36 1.37")
#   CSI_DRIVER_BIN   a built csi-driver: also check that it accepts every flag
#                    the manifests pass to it (its --help)
#   KUSTOMIZE        a kustomize binary to use instead of the pinned one
#   HELM             a helm binary to use instead of the pinned one
#
# Exits non-zero on any failure.
set -euo pipefail

DEPLOY="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$DEPLOY")"
SCRIPT_NAME=validate
# shellcheck source=scripts/preamble.sh
. "$REPO/scripts/preamble.sh"
K8S_VERSIONS="${K8S_VERSIONS:-1.35 1.36 1.37}"
KUSTOMIZE_VERSION="v5.8.2"         # the newest that builds with this machine's Go 1.26
HELM_VERSION="v3.19.0"
KUBERNETES_VALIDATE_VERSION="1.37.0"
YAMLLINT_VERSION="1.38.0"
OVERLAYS=(central central-attach distributed cluster)
# Each overlay is also validated with each component it takes (generate.py
# says which).
COMPONENTS=(builtin-sidecars inline-ephemeral snapshot-metadata)
PYTHON="${PYTHON:-python3}"

step() { printf '\n### %s\n' "$*"; }

# ------------------------------------------------------------ tools
step "tools"
if ! "$PYTHON" -c 'import kubernetes_validate, yaml, jsonschema' 2>/dev/null \
    || ! "$PYTHON" -m yamllint --version >/dev/null 2>&1; then
  echo "installing kubernetes-validate==$KUBERNETES_VALIDATE_VERSION yamllint==$YAMLLINT_VERSION"
  "$PYTHON" -m pip install --quiet --disable-pip-version-check \
    "kubernetes-validate==$KUBERNETES_VALIDATE_VERSION" "yamllint==$YAMLLINT_VERSION" pyyaml jsonschema \
    || die "pip install failed"
fi
echo "python: $("$PYTHON" --version 2>&1); kubernetes-validate $("$PYTHON" -c \
  'import kubernetes_validate as k; print(k.version.__version__)'); $("$PYTHON" -m yamllint --version)"

gobin=""
if command -v go >/dev/null 2>&1; then
  gobin="$(go env GOBIN)"
  [[ -n "$gobin" ]] || gobin="$(go env GOPATH)/bin"
fi
kustomize_cmd=()
if [[ -n "${KUSTOMIZE:-}" ]]; then
  kustomize_cmd=("$KUSTOMIZE" build)
else
  if [[ -n "$gobin" && -x "$gobin/kustomize" && "$("$gobin/kustomize" version 2>/dev/null)" == "$KUSTOMIZE_VERSION" ]]; then
    kustomize_cmd=("$gobin/kustomize" build)
  elif [[ -n "$gobin" ]]; then
    echo "installing sigs.k8s.io/kustomize/kustomize/v5@$KUSTOMIZE_VERSION with go install"
    if (cd "${TMPDIR:-/tmp}" && GOTOOLCHAIN=local GOFLAGS=-mod=mod \
          go install "sigs.k8s.io/kustomize/kustomize/v5@$KUSTOMIZE_VERSION"); then
      kustomize_cmd=("$gobin/kustomize" build)
    fi
  fi
  if [[ ${#kustomize_cmd[@]} -eq 0 ]]; then
    if command -v kubectl >/dev/null 2>&1; then
      echo "NOTE: no kustomize $KUSTOMIZE_VERSION; using kubectl's built-in kustomize"
      kustomize_cmd=(kubectl kustomize)
    else
      die "no kustomize: install Go (for go install) or kubectl"
    fi
  fi
fi
echo "kustomize: ${kustomize_cmd[*]} ($("${kustomize_cmd[0]}" version 2>/dev/null | head -1 || true))"

# helm: the chart's checks are part of the validation, so no helm is a failure.
helm="${HELM:-}"
if [[ -z "$helm" ]]; then
  [[ -n "$gobin" ]] || die "no helm: install Go (for go install) or set HELM"
  helm="$gobin/helm"
  # The module version built in (helm's own version string lacks the patch
  # number when it is built without release ldflags).
  if [[ ! -x "$helm" || "$(go version -m "$helm" 2>/dev/null | awk '$1 == "mod" {print $3}')" != "$HELM_VERSION" ]]; then
    echo "installing helm.sh/helm/v3/cmd/helm@$HELM_VERSION with go install (a few minutes the first time)"
    (cd "${TMPDIR:-/tmp}" && GOTOOLCHAIN=local GOFLAGS=-mod=mod \
        go install "helm.sh/helm/v3/cmd/helm@$HELM_VERSION") || die "go install of helm failed"
  fi
fi
echo "helm: $helm ($("$helm" version --short 2>/dev/null || true))"

# ------------------------------------------------------------ tree
step "the kustomize tree, written from the chart by deploy/generate.py"
# The snapshot-metadata component's TLS material (made once, not in git).
"$DEPLOY/components/snapshot-metadata/make-certs.sh" >/dev/null || die "make-certs.sh failed"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
mkdir -p "$out/chart" "$out/values"
"$PYTHON" "$DEPLOY/generate.py" --check --helm "$helm" --kustomize "${kustomize_cmd[0]}" --renders "$out/chart" \
  || die "the kustomize tree is not what the chart makes: run python3 deploy/generate.py and commit what it writes"
rendered=()
for f in "$out"/chart/*.yaml; do
  n="$(basename "$f" .yaml)"
  printf '  %-34s %3d objects: %s\n' "$n" "$(grep -c '^kind: ' "$f")" \
    "$(grep '^kind: ' "$f" | cut -d' ' -f2 | sort | uniq -c | awk '{printf "%s%s×%s", (NR>1?", ":""), $2, $1}')"
  rendered+=(--rendered "$n=$f")
done

# ------------------------------------------------------------ yamllint
step "yamllint (deploy/.yamllint, strict)"
(cd "$DEPLOY" && "$PYTHON" -m yamllint -c .yamllint -s .) || die "yamllint found problems"
echo "  $(cd "$DEPLOY" && find . -name '*.yaml' -not -path './schemas/*' -not -path './helm/*/templates/*' | wc -l) YAML files clean"

# ------------------------------------------------------------ chart values
step "check_values.py (the values of deploy/helm/example-csi)"
"$PYTHON" "$DEPLOY/check_values.py" --helm "$helm" --out "$out/values" || die "chart checks failed"
for f in "$out"/values/chart-*.yaml; do
  n="$(basename "$f" .yaml)"
  rendered+=(--rendered "$n=$f")
done

# Images pinned by digest, as an operator pins them where a registry serves
# digests: a kustomize images: block with newTag and digest for every image
# of an overlay (the digests here are made up for the check: the form is
# what is checked, never an image).
for o in "${OVERLAYS[@]}"; do
  k="$out/$o+digests"
  mkdir -p "$k"
  rel="$(realpath --relative-to="$k" "$DEPLOY")"
  {
    printf 'apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - %s\nimages:\n' "$rel/overlays/$o"
    grep -oE 'image: [^[:space:]]+' "$out/chart/$o.yaml" | sort -u | while read -r _ image; do
      printf '  - name: %s\n    newTag: %s\n    digest: sha256:%s\n' "${image%:*}" "${image##*:}" \
        "$(printf '%s' "$image" | sha256sum | cut -c1-64)"
    done
  } >"$k/kustomization.yaml"
  "${kustomize_cmd[@]}" "$k" >"$k.yaml" || die "kustomize build of overlays/$o with image digests failed"
  rendered+=(--rendered "$o+digests=$k.yaml")
done

# ------------------------------------------------------------ checks
step "check_manifests.py (the chart's renderings, the overlays with image digests)"
versions=()
for v in $K8S_VERSIONS; do versions+=(--k8s-version "$v"); done
binary=()
if [[ -n "${CSI_DRIVER_BIN:-}" ]]; then
  binary=(--check-binary "$CSI_DRIVER_BIN")
fi
"$PYTHON" "$DEPLOY/check_manifests.py" "${versions[@]}" "${rendered[@]}" \
  --examples "$DEPLOY/examples" "${binary[@]}" || die "manifest checks failed"

# ------------------------------------------------------------ pins
# The sidecar versions are pinned in deploy/ alone; the end-to-end test
# (e2e/versions.sh) builds each image deploy/ names at that version.
step "e2e/versions.sh builds every sidecar deploy/ pins"
# shellcheck source=../e2e/versions.sh
. "$REPO/e2e/versions.sh"
fail=0
while read -r image; do
  name=${image#registry.k8s.io/sig-storage/}; tag=${name#*:}; tag=${tag%%@*}; name=${name%%:*}
  if [[ "${SIDECAR_VERSIONS[$name]:-}" == "$tag" ]]; then
    echo "  ok    $name $tag"
  else
    echo "  FAIL  deploy/ runs $name $tag, e2e/versions.sh builds '${SIDECAR_VERSIONS[$name]:-nothing}'"; fail=1
  fi
done < <(for r in "${rendered[@]}"; do [[ "$r" == --rendered ]] || cat "${r#*=}"; done \
           | grep -oE 'registry\.k8s\.io/sig-storage/[a-z0-9-]+:[^"[:space:]]+' | sort -u)
for name in "${!SIDECAR_VERSIONS[@]}"; do
  [[ -n "${SIDECAR_VERSIONS[$name]}" ]] || { echo "  FAIL  no version of $name found in deploy/"; fail=1; }
done
[[ $fail -eq 0 ]] || die "sidecar pins and e2e/versions.sh disagree"

# ------------------------------------------------------------ image
step "Dockerfile"
dockerfile="$REPO/Dockerfile"
[[ -f "$dockerfile" ]] || die "no Dockerfile"
fail=0
while read -r img; do
  if [[ "$img" != *:* || "$img" == *:latest ]]; then
    echo "  FAIL  base image $img is not pinned"; fail=1
  else
    echo "  ok    base image $img pinned"
  fi
done < <(awk 'toupper($1)=="FROM"{print $2}' "$dockerfile")
for pkg in util-linux mount e2fsprogs xfsprogs btrfs-progs; do
  if grep -Eq "^[[:space:]]+${pkg}([[:space:]]|\\\\|$)" "$dockerfile"; then
    echo "  ok    runtime installs $pkg"
  else
    echo "  FAIL  runtime does not install $pkg"; fail=1
  fi
done
if grep -q -- '--bin csi-driver' "$dockerfile"; then echo "  ok    builds --bin csi-driver"; else echo "  FAIL  does not build --bin csi-driver"; fail=1; fi
if grep -qx 'target/\?' "$REPO/.dockerignore" 2>/dev/null || grep -qx '/target/\?' "$REPO/.dockerignore" 2>/dev/null; then
  echo "  ok    .dockerignore excludes target/"
else
  echo "  FAIL  .dockerignore does not exclude target/"; fail=1
fi
[[ $fail -eq 0 ]] || die "Dockerfile checks failed"

printf '\nvalidate.sh: deploy/ is valid (the Helm chart, and the kustomize tree written from it: overlays %s; each also with: %s; Kubernetes %s)\n' \
  "${OVERLAYS[*]}" "${COMPONENTS[*]}" "$K8S_VERSIONS"
