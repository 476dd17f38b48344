#!/usr/bin/env bash
# Builds (or reuses from the cache) every binary the end-to-end test runs that
# does not come from Debian: Kubernetes (kube-apiserver, kube-controller-manager,
# kube-scheduler, kubelet, kubectl), etcd, containerd, and the kubernetes-csi
# sidecars at the versions deploy/ pins (external-provisioner, -attacher,
# -resizer, -snapshotter with snapshot-controller and the snapshot CRDs,
# node-driver-registrar, livenessprobe). With --suite it also builds
# Kubernetes' e2e test binary and agnhost, and what the suite deploys beside
# the driver (hello-populator, volume-data-source-validator).
#
# Everything is built from released sources into
# $EXAMPLE_CSI_E2E_CACHE (default ~/.cache/example-csi-e2e), one folder per
# component and version, so a second run costs nothing. The sources come
# from the Go module proxy, as anyone with the internet gets them; a module the
# proxy refuses (or serves without a local module its go.mod points at) comes
# from its released source archive in $EXAMPLE_CSI_UPSTREAM_ARCHIVES (default
# ../shared/upstream from the project's root), checked against the SHA-256
# sums of e2e/versions.sh.
#
#   e2e/build.sh [--suite] [component ...]     components: kubernetes etcd containerd
#                                              provisioner attacher resizer snapshotter
#                                              registrar livenessprobe snapshot-metadata
#                                              snapshot-metadata-lister
#                                              suite populator validator
#                                              hostpath (the reference driver, for --bench)
#   e2e/build.sh --check [--suite]             succeeds when all of them are built
set -euo pipefail
. "$(dirname "$0")/versions.sh"
SCRIPT_NAME=e2e/build
# shellcheck source=scripts/preamble.sh
. "$(dirname "$0")/../scripts/preamble.sh"
# -mod=mod: the wrapper modules and the copied sidecar modules record their
# go.sum as they build
export GOFLAGS="-mod=mod -buildvcs=false" CGO_ENABLED=0

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

UPSTREAM_ARCHIVES=${EXAMPLE_CSI_UPSTREAM_ARCHIVES:-$E2E_ROOT/../shared/upstream}

# local_replacements DIR: the folders DIR's go.mod replaces modules with.
local_replacements() {
    sed -n 's#.*=>[[:space:]]*\(\./[^[:space:]]*\).*#\1#p' "$1/go.mod"
}

# source_of MODULE VERSION ARCHIVE [SUBDIR]: a writable copy of a released
# module's source, from the Go module proxy; or, when the proxy refuses it or
# serves a copy without a folder its go.mod replaces a module with (a module
# of its own, which the proxy refuses), from the released source archive
# ARCHIVE (SUBDIR of it for a module in a subfolder of its repository).
source_of() {
    local module=$1 version=$2 archive=$3 sub=${4:-}
    local copy="$E2E_CACHE/src/${module//\//_}@$version"
    [ -d "$copy" ] && { echo "$copy"; return 0; }
    local dir r missing=""
    dir=$(go mod download -json "$module@$version" 2>/dev/null | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p') || true
    if [ -d "$dir" ]; then
        for r in $(local_replacements "$dir"); do [ -d "$dir/$r" ] || missing="$missing $r"; done
        if [ -z "$missing" ]; then
            rm -rf "$copy.tmp"; mkdir -p "$(dirname "$copy")"
            cp -r "$dir" "$copy.tmp" && chmod -R u+w "$copy.tmp" && mv "$copy.tmp" "$copy"
            echo "$copy"; return 0
        fi
        log "the module proxy's $module@$version lacks$missing (modules of their own): using its source archive"
    else
        log "the module proxy does not serve $module@$version: using its source archive"
    fi
    local file=$UPSTREAM_ARCHIVES/$archive sum=${UPSTREAM_SHA256[$archive]:-}
    [ -f "$file" ] || { log "no source archive $file (set EXAMPLE_CSI_UPSTREAM_ARCHIVES)"; return 1; }
    if [ -z "$sum" ] || [ "$(sha256sum "$file" | cut -d' ' -f1)" != "$sum" ]; then
        log "$file is not the archive e2e/versions.sh pins (SHA-256)"; return 1
    fi
    rm -rf "$copy.tmp"; mkdir -p "$copy.tmp"
    tar -xzf "$file" -C "$copy.tmp" --strip-components=1 || return 1
    if [ -n "$sub" ]; then
        mv "$copy.tmp" "$copy.all" && mv "$copy.all/$sub" "$copy.tmp" && rm -rf "$copy.all"
    fi
    mv "$copy.tmp" "$copy"
    echo "$copy"
}

# build_released NAME MODULE VERSION ARCHIVE PACKAGE...: NAME's commands from
# its released source (source_of), into $E2E_CACHE/NAME-VERSION.
build_released() {
    local name=$1 module=$2 version=$3 archive=$4; shift 4
    local out="$E2E_CACHE/$name-$version"
    built "$out" && return 0
    log "building $name $version"
    local dir; dir=$(source_of "$module" "$version" "$archive") || return 1
    mkdir -p "$out"
    local pkg
    for pkg in "$@"; do
        (cd "$dir" && go build -trimpath -ldflags "-s -w -X main.version=$version" -o "$out/" "./$pkg")
    done
    touch "$out/.complete"
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
        # A staging module the proxy does not serve at this release (the
        # sample-* ones, which none of the commands imports) is replaced by an
        # empty module, so that the module graph still resolves.
        local m served=() stubbed=()
        for m in $staging; do
            if go mod download "$m@$minor" 2>/dev/null; then served+=("$m"); else
                case $m in
                    k8s.io/sample-*) stubbed+=("$m") ;;
                    *) log "the module proxy does not serve $m@$minor"; return 1 ;;
                esac
            fi
        done
        {
            echo "module example-csi.invalid/k8s-build"
            echo
            sed -n 's/^go \(.*\)/go \1/p' "$kdir/go.mod"
            echo
            echo "require k8s.io/kubernetes $KUBERNETES_VERSION"
            for m in "${served[@]}"; do echo "require $m $minor"; done
            for m in "${served[@]}"; do echo "replace $m => $m $minor"; done
            for m in "${stubbed[@]}"; do echo "replace $m => ./unserved/${m##*/}"; done
        } >"$dir/go.mod"
        for m in "${stubbed[@]}"; do
            mkdir -p "$dir/unserved/${m##*/}"
            printf 'module %s\n' "$m" >"$dir/unserved/${m##*/}/go.mod"
        done
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

# external-snapshot-metadata: the sidecar.
build_snapshot_metadata() {
    build_released snapshot-metadata github.com/kubernetes-csi/external-snapshot-metadata \
        "$SNAPSHOT_METADATA_VERSION" "external-snapshot-metadata-$SNAPSHOT_METADATA_VERSION.tar.gz" \
        cmd/csi-snapshot-metadata
}

# snapshot-metadata-lister, the scenarios' backup client: a module of its own
# in external-snapshot-metadata's repository. Its go.mod at the release's tag
# still requires the module at v0.2.0, whose client asks for
# cbt.storage.k8s.io/v1alpha1, which the release's CRD no longer serves
# (v1beta1 only); so it is built against the release's own source.
build_snapshot_metadata_lister() {
    local v=$SNAPSHOT_METADATA_VERSION tool=snapshot-metadata-lister
    local out="$E2E_CACHE/$tool-$v" module=github.com/kubernetes-csi/external-snapshot-metadata
    local archive="external-snapshot-metadata-$v.tar.gz"
    built "$out" && return 0
    log "building $tool $v"
    local main dir
    main=$(source_of "$module" "$v" "$archive") || return 1
    dir=$(source_of "$module/tools/$tool" "$v" "$archive" "tools/$tool") || return 1
    mkdir -p "$out"
    (cd "$dir" && go mod edit -replace "$module=$main" -replace "$module/client=$main/client" \
        && GOFLAGS=-mod=mod go build -trimpath -ldflags "-s -w" -o "$out/$tool" .)
    touch "$out/.complete"
}

# containerd 2 (the kubelet of Kubernetes 1.37 needs it) with its runc shim
# and ctr, without the btrfs snapshotter (it needs C headers); runc itself is
# Debian's.
build_containerd() {
    local out="$E2E_CACHE/containerd-$CONTAINERD_VERSION"
    built "$out" && return 0
    log "building containerd $CONTAINERD_VERSION"
    local dir; dir=$(go_module_dir github.com/containerd/containerd/v2 "$CONTAINERD_VERSION")
    mkdir -p "$out"
    (cd "$dir" && go build -trimpath -tags no_btrfs \
        -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION" \
        -o "$out/" ./cmd/containerd ./cmd/containerd-shim-runc-v2 ./cmd/ctr)
    touch "$out/.complete"
}

check=0
[ "${1:-}" = --check ] && { shift; check=1; }
all=(kubernetes etcd containerd provisioner attacher resizer snapshotter registrar livenessprobe snapshot-metadata
     snapshot-metadata-lister)
[ "${1:-}" = --suite ] && { shift; all+=(suite populator validator); }
[ $# -gt 0 ] && all=("$@")
for c in "${all[@]}"; do
    case $c in
        kubernetes) build_kubernetes ;;
        suite) build_suite ;;
        etcd) build_etcd ;;
        containerd) build_containerd ;;
        snapshot-metadata) build_snapshot_metadata ;;
        snapshot-metadata-lister) build_snapshot_metadata_lister ;;
        registrar) build_released registrar github.com/kubernetes-csi/node-driver-registrar "$REGISTRAR_VERSION" \
                       "node-driver-registrar-$REGISTRAR_VERSION.tar.gz" cmd/csi-node-driver-registrar ;;
        livenessprobe) build_released livenessprobe github.com/kubernetes-csi/livenessprobe "$LIVENESSPROBE_VERSION" \
                           "livenessprobe-$LIVENESSPROBE_VERSION.tar.gz" cmd/livenessprobe ;;
        populator) build_released populator github.com/kubernetes-csi/lib-volume-populator/v3 "$POPULATOR_VERSION" \
                       "lib-volume-populator-$POPULATOR_VERSION.tar.gz" example/hello-populator ;;
        hostpath) build_released hostpath github.com/kubernetes-csi/csi-driver-host-path "$HOSTPATH_VERSION" \
                      "csi-driver-host-path-$HOSTPATH_VERSION.tar.gz" cmd/hostpathplugin ;;
        validator) build_released validator github.com/kubernetes-csi/volume-data-source-validator "$VALIDATOR_VERSION" \
                       "volume-data-source-validator-$VALIDATOR_VERSION.tar.gz" cmd/volume-data-source-validator ;;
        provisioner) build_sidecar provisioner github.com/kubernetes-csi/external-provisioner/v6 "$PROVISIONER_VERSION" cmd/csi-provisioner ;;
        attacher) build_sidecar attacher github.com/kubernetes-csi/external-attacher/v4 "$ATTACHER_VERSION" cmd/csi-attacher ;;
        resizer) build_sidecar resizer github.com/kubernetes-csi/external-resizer/v2 "$RESIZER_VERSION" cmd/csi-resizer ;;
        snapshotter) build_sidecar snapshotter github.com/kubernetes-csi/external-snapshotter/v8 "$SNAPSHOTTER_VERSION" cmd/csi-snapshotter cmd/snapshot-controller ;;
        *) log "unknown component $c"; exit 2 ;;
    esac
done
log "ready in $E2E_CACHE"
