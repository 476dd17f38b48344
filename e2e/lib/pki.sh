# shellcheck shell=bash
# The cluster's certificates and kubeconfigs, made with openssl: one CA, the API
# server's serving certificate, and one client certificate per component
# (the kubelet's in system:nodes, as NodeRestriction requires).

# pki_make DIR HOST_IP SERVICE_IP NODE_NAME...
pki_make() {
    local dir=$1 host_ip=$2 service_ip=$3; shift 3
    mkdir -p "$dir"
    (
        cd "$dir" || exit 1
        openssl genrsa -out ca.key 2048 2>/dev/null
        openssl req -x509 -new -key ca.key -days 2 -subj "/CN=example-csi-e2e-ca" -out ca.crt 2>/dev/null
        openssl genrsa -out sa.key 2048 2>/dev/null
        openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
        cert apiserver "/CN=kube-apiserver" \
            "subjectAltName=IP:127.0.0.1,IP:$host_ip,IP:$service_ip,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
        cert admin "/O=system:masters/CN=e2e-admin"
        cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client"
        cert controller-manager "/CN=system:kube-controller-manager"
        cert scheduler "/CN=system:kube-scheduler"
        local n
        for n in "$@"; do
            cert "kubelet-$n" "/O=system:nodes/CN=system:node:$n"
            cert "kubelet-serving-$n" "/CN=$n" "subjectAltName=IP:127.0.0.1,IP:$host_ip,DNS:$n,DNS:localhost"
        done
    )
}

# cert NAME SUBJECT [EXTENSION]: NAME.key and NAME.crt signed by the CA (in the cwd)
cert() {
    openssl genrsa -out "$1.key" 2048 2>/dev/null
    openssl req -new -key "$1.key" -subj "$2" -out "$1.csr" 2>/dev/null
    if [ -n "${3:-}" ]; then
        openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 \
            -extfile <(echo "$3") -out "$1.crt" 2>/dev/null
    else
        openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 -out "$1.crt" 2>/dev/null
    fi
    rm -f "$1.csr"
}

# kubeconfig FILE SERVER PKI NAME: a kubeconfig with NAME's client certificate
kubeconfig() {
    local file=$1 server=$2 pki=$3 name=$4
    cat >"$file" <<EOF
apiVersion: v1
kind: Config
clusters:
  - name: e2e
    cluster:
      server: $server
      certificate-authority: $pki/ca.crt
users:
  - name: $name
    user:
      client-certificate: $pki/$name.crt
      client-key: $pki/$name.key
contexts:
  - name: e2e
    context: {cluster: e2e, user: $name}
current-context: e2e
EOF
}
