#!/usr/bin/env bash
# Builds (or reuses from the cache) every binary the end-to-end test runs that
# does not come from Debian: Kubernetes (kube-apiserver, kube-controller-manager,
# kube-scheduler, kubelet, kubectl), etcd, and the kubernetes-csi sidecars at the
# versions deploy/ pins (external-provisioner, -attacher, -resizer, -snapshotter
# with snapshot-controller and the snapshot CRDs). With --suite it also builds
# Kubernetes' e2e test binary and agnhost.
#
# Everything is built from the Go module proxy into
# $EXAMPLE_CSI_E2E_CACHE (default ~/.cache/example-csi-e2e), one folder per
# component and version, so a second run costs nothing.
#
#   e2e/build.sh [--suite] [component ...]     components: kubernetes etcd
#                                              provisioner attacher resizer snapshotter suite
#   e2e/build.sh --check [--suite]             succeeds when all of them are built
set -euo pipefail
. "$(dirname "$0")/versions.sh"
export PATH="$PATH:/usr/local/go/bin:$HOME/go/bin"
# -mod=mod: the wrapper modules and the copied sidecar modules record their
# go.sum as they build
export GOFLAGS="-mod=mod -buildvcs=false" CGO_ENABLED=0

log() { echo "e2e/build: $*" >&2; }
SNAPSHOTTER_CLIENT=github.com/kubernetes-csi/external-snapshotter/client/v8

# go_module_dir MODULE VERSION: a writable copy of a module's source.
go_module_dir() {
    local dir
    dir=$(go mod download -json "$1@$2" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
    [ -d "$dir" ] || { log "cannot download $1@$2"; return 1; }
    local copy="$E2E_CACHE/src/${1//\//_}@$2"
    if [ ! -d "$copy" ]; then
        rm -rf "$copy.tmp"; mkdir -p "$(dirname "$copy")"
        cp -r "$dir" "$copy.tmp" && chmod -R u+w "$copy.tmp" && mv "$copy.tmp" "$copy"
    fi
    echo "$copy"
}

# built DIR: true when DIR holds a finished build. With --check, a missing one
# ends the script with a failure instead of being built.
built() {
    [ -f "$1/.complete" ] && return 0
    [ "${check:-0}" = 1 ] && { log "not built yet: ${1##*/}"; exit 1; }
    return 1
}

# A throw-away module that requires k8s.io/kubernetes and pins every staging
# module it replaces with a local path to the published version of the same
# release, so that its commands and its e2e suite build outside its tree.
kubernetes_module() {
    local dir="$E2E_CACHE/src/k8s-wrapper-$KUBERNETES_VERSION"
    if [ ! -f "$dir/go.sum" ]; then
        local kdir staging minor
        kdir=$(go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
        staging=$(sed -n '/^replace (/,/^)/p' "$kdir/go.mod" | awk '/=> \.\/staging/ {print $1}')
        minor="v0${KUBERNETES_VERSION#v1}"
        mkdir -p "$dir"
        {
            echo "module example-csi.invalid/k8s-build"
            echo
            sed -n 's/^go \(.*\)/go \1/p' "$kdir/go.mod"
            echo
            echo "require k8s.io/kubernetes $KUBERNETES_VERSION"
            for m in $staging; do echo "require $m $minor"; done
            for m in $staging; do echo "replace $m => $m $minor"; done
        } >"$dir/go.mod"
        printf 'package k8sbuild\n' >"$dir/doc.go"
        (cd "$dir" && go mod download k8s.io/kubernetes && go list -deps k8s.io/kubernetes/cmd/kubelet >/dev/null)
    fi
    echo "$dir"
}

kubernetes_ldflags() {
    local v=$KUBERNETES_VERSION major minor
    major=${v#v}; major=${major%%.*}
    minor=${v#v*.}; minor=${minor%%.*}
    local p
    for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
        printf -- '-X %s.gitVersion=%s -X %s.gitMajor=%s -X %s.gitMinor=%s -X %s.gitTreeState=clean -X %s.buildDate=1970-01-01T00:00:00Z ' \
            "$p" "$v" "$p" "$major" "$p" "$minor" "$p" "$p"
    done
    echo "-s -w"
}

build_kubernetes() {
    local out="$E2E_CACHE/kubernetes-$KUBERNETES_VERSION"
    built "$out" && return 0
    log "building Kubernetes $KUBERNETES_VERSION (about 12 minutes on 2 cores)"
    local mod; mod=$(kubernetes_module)
    mkdir -p "$out"
    (cd "$mod" && go build -trimpath -ldflags "$(kubernetes_ldflags)" -o "$out/" \
        k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
        k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kubectl)
    touch "$out/.complete"
}

# The External Storage suite: the e2e test binary, agnhost (static: it runs in
# a busybox image) and the ginkgo command that runs the binary in parallel, all
# at the versions the release's own go.mod asks for.
build_suite() {
    local out="$E2E_CACHE/suite-$KUBERNETES_VERSION"
    built "$out" && [ -x "$out/ginkgo" ] && return 0
    log "building Kubernetes' e2e test binary, agnhost and ginkgo $KUBERNETES_VERSION"
    local mod; mod=$(kubernetes_module)
    mkdir -p "$out"
    [ -x "$out/e2e.test" ] ||
        (cd "$mod" && go test -c -trimpath -ldflags "$(kubernetes_ldflags)" -o "$out/e2e.test" k8s.io/kubernetes/test/e2e)
    if [ ! -x "$out/agnhost" ] || ldd "$out/agnhost" >/dev/null 2>&1; then
        (cd "$mod" && CGO_ENABLED=0 go build -trimpath -o "$out/agnhost" k8s.io/kubernetes/test/images/agnhost)
    fi
    [ -x "$out/ginkgo" ] ||
        (cd "$mod" && GOFLAGS=-mod=mod go build -trimpath -o "$out/ginkgo" github.com/onsi/ginkgo/v2/ginkgo)
    touch "$out/.complete"
}

build_etcd() {
    local out="$E2E_CACHE/etcd-$ETCD_VERSION"
    built "$out" && return 0
    log "building etcd $ETCD_VERSION"
    local dir="$E2E_CACHE/src/etcd-main-$ETCD_VERSION"
    mkdir -p "$dir" "$out"
    cat >"$dir/go.mod" <<GOMOD
module example-csi.invalid/etcd

go 1.24

require go.etcd.io/etcd/server/v3 $ETCD_VERSION
GOMOD
    cat >"$dir/main.go" <<'GO'
// etcd, started through its own command-line entry point.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
GO
    (cd "$dir" && go build -trimpath -o "$out/etcd" .)
    touch "$out/.complete"
}

# build_sidecar NAME MODULE VERSION PACKAGE...
build_sidecar() {
    local name=$1 module=$2 version=$3; shift 3
    local out="$E2E_CACHE/$name-$version"
    built "$out" && return 0
    log "building $name $version"
    local dir; dir=$(go_module_dir "$module" "$version")
    mkdir -p "$out"
    if [ "$name" = snapshotter ]; then
        # its go.mod points the client module at a local folder that the
        # published module does not hold: use the published client instead
        (cd "$dir" && go mod edit -dropreplace "$SNAPSHOTTER_CLIENT" -require "$SNAPSHOTTER_CLIENT@$version")
    fi
    local pkg
    for pkg in "$@"; do
        (cd "$dir" && go build -trimpath -ldflags "-s -w -X main.version=$version" -o "$out/" "./$pkg")
    done
    if [ "$name" = snapshotter ]; then
        local client; client=$(go mod download -json "$SNAPSHOTTER_CLIENT@$version" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
        mkdir -p "$out/crds"
        cp "$client"/config/crd/*.yaml "$out/crds/"
        rm -f "$out/crds/kustomization.yaml"
    fi
    touch "$out/.complete"
}

check=0
[ "${1:-}" = --check ] && { shift; check=1; }
all=(kubernetes etcd provisioner attacher resizer snapshotter)
[ "${1:-}" = --suite ] && { shift; all+=(suite); }
[ $# -gt 0 ] && all=("$@")
for c in "${all[@]}"; do
    case $c in
        kubernetes) build_kubernetes ;;
        suite) build_suite ;;
        etcd) build_etcd ;;
        provisioner) build_sidecar provisioner github.com/kubernetes-csi/external-provisioner/v6 "$PROVISIONER_VERSION" cmd/csi-provisioner ;;
        attacher) build_sidecar attacher github.com/kubernetes-csi/external-attacher/v4 "$ATTACHER_VERSION" cmd/csi-attacher ;;
        resizer) build_sidecar resizer github.com/kubernetes-csi/external-resizer/v2 "$RESIZER_VERSION" cmd/csi-resizer ;;
        snapshotter) build_sidecar snapshotter github.com/kubernetes-csi/external-snapshotter/v8 "$SNAPSHOTTER_VERSION" cmd/csi-snapshotter cmd/snapshot-controller ;;
        *) log "unknown component $c"; exit 2 ;;
    esac
done
log "ready in $E2E_CACHE"
