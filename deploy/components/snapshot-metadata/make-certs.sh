#!/usr/bin/env bash
# Makes the TLS material of the snapshot-metadata component in tls/ next to
# this script, unless it is there: a CA (ca.crt; its key is thrown away) and
# the certificate of the service example-csi-snapshot-metadata in namespace
# example-csi, signed by it (tls.crt, tls.key). Run it again after removing
# tls/ to rotate them. SNAPSHOT_METADATA_DAYS sets the validity (default 365).
# Also writes tls/ca-cert.yaml, the patch that gives the SnapshotMetadataService
# that CA.
set -euo pipefail
dir="$(cd "$(dirname "$0")" && pwd)/tls"
service=example-csi-snapshot-metadata
namespace=example-csi
days=${SNAPSHOT_METADATA_DAYS:-365}

# ca_patch: tls/ca-cert.yaml from tls/ca.crt, its base64 on one line (the
# CRD's caCert is of format byte, which refuses line breaks).
ca_patch() {
  cat >"$dir/ca-cert.yaml" <<EOF
---
apiVersion: cbt.storage.k8s.io/v1beta1
kind: SnapshotMetadataService
metadata:
  name: example.csi.k8s.io
spec:
  caCert: $(base64 -w0 "$dir/ca.crt")
EOF
}

if [[ -f "$dir/tls.crt" && -f "$dir/tls.key" && -f "$dir/ca.crt" ]]; then
  ca_patch
  echo "make-certs.sh: $dir holds a certificate already"
  exit 0
fi
command -v openssl >/dev/null || { echo "make-certs.sh: needs openssl" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
ec=(-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes)
openssl req -x509 "${ec[@]}" -days "$days" -subj "/CN=$service-ca" \
  -keyout "$tmp/ca.key" -out "$tmp/ca.crt" 2>/dev/null
openssl req "${ec[@]}" -subj "/CN=$service.$namespace" -keyout "$tmp/tls.key" -out "$tmp/tls.csr" 2>/dev/null
printf 'subjectAltName=DNS:%s.%s,DNS:%s.%s.svc,DNS:%s.%s.svc.cluster.local\nextendedKeyUsage=serverAuth\n' \
  "$service" "$namespace" "$service" "$namespace" "$service" "$namespace" >"$tmp/ext"
openssl x509 -req -in "$tmp/tls.csr" -CA "$tmp/ca.crt" -CAkey "$tmp/ca.key" -CAcreateserial \
  -days "$days" -extfile "$tmp/ext" -out "$tmp/tls.crt" 2>/dev/null
mkdir -p "$dir"
install -m 0644 "$tmp/ca.crt" "$dir/ca.crt"
install -m 0644 "$tmp/tls.crt" "$dir/tls.crt"
install -m 0600 "$tmp/tls.key" "$dir/tls.key"
ca_patch
echo "make-certs.sh: wrote $dir (valid $days days)"
