# shellcheck shell=bash
# The globals set here are read by the other e2e/lib/*.sh files.
# shellcheck disable=SC2034
# Kubernetes' own storage e2e suite, "External Storage": the e2e test binary of
# the cluster's release, given e2e/testdriver.yaml, runs every test pattern of
# every storage test suite against the driver as the central overlay deploys
# it (or SUITE_FLAVOR's overlay: cluster, on every node of NODES). The suite skips on its own what the test-driver file says the driver
# cannot do; e2e/skips.md lists, with reasons, the patterns this runner skips
# on top of that. The result (counts, every failure, the suite's own skip
# reasons) is in $W/suite/summary.txt and printed.
#
# Needs: E2E_ROOT, E2E_CACHE, W, KUBERNETES_VERSION, kc, deploy_flavor,
# undeploy_flavor, the checks of checks.sh.

SUITE_PROCS=${SUITE_PROCS:-4}
# The node plugin's volume limit while the suite runs (CSINode's allocatable
# count): the volume limit tests fill it and check that one more pod is
# refused by the scheduler; room enough for the tests that run beside each
# other meanwhile.
SUITE_VOLUME_LIMIT=${SUITE_VOLUME_LIMIT:-32}
SUITE_TIMEOUT=${SUITE_TIMEOUT:-3h}
# A narrower focus (a regex of test names) may be given; it should keep the
# driver's name, or other drivers' tests would be asked for.
SUITE_FOCUS=${SUITE_FOCUS:-'External.Storage \[Driver: example\.csi\.k8s\.io\]'}

# The skip patterns: the first column of e2e/skips.md's tables, `PATTERN`
# (a `\|` there is a table's escaped bar); the rows whose reason begins
# "where ext4 cannot grow mounted" only where that is so.
suite_skip_patterns() {
    local rows
    rows=$(grep -E '^\| `' "$E2E_ROOT/e2e/skips.md")
    can_grow_ext4_online && rows=$(grep -v '` | where ext4 cannot grow mounted' <<<"$rows")
    sed -n 's/^| `\(.*\)` | .*$/\1/p' <<<"$rows" | sed 's/\\|/|/g'
}

# The test images the suite's storage tests run, under the names this release
# asks for: busybox as for the scenarios; agnhost built from the release's
# sources on the same busybox layer (the tests run shell commands in it too);
# glibc-dns-testing (the multi-volume tests want GNU dd and sha256sum) and
# nginx (the exec test wants a shell and chmod) as the Debian root filesystem
# of the driver's image; hello-populator and volume-data-source-validator
# (the "any volume data source" test deploys them) built from their released
# sources, under the names the release's test manifests give them. Made after
# build_images, before the nodes start (they import every image).
suite_images() {
    local bin=$E2E_CACHE/suite-$KUBERNETES_VERSION dir=$W/images
    local names name i=0
    names=$("$bin/e2e.test" --list-images \
        | grep -E '^registry\.k8s\.io/e2e-test-images/(busybox|agnhost|glibc-dns-testing|nginx):')
    grep -q /agnhost: <<<"$names" && grep -q /busybox: <<<"$names" \
        || die "the suite does not name its busybox and agnhost images"
    rm -rf "$dir/agnhost"; cp -a "$dir/busybox" "$dir/agnhost"
    cp "$bin/agnhost" "$dir/agnhost/agnhost"
    for name in $names; do
        i=$((i + 1))
        case $name in
            */busybox:*) python3 "$E2E_ROOT/e2e/lib/mkimage.py" "$dir/suite-$i.tar" "$name" \
                             --layer "$dir/busybox" --cmd '["sh"]' ;;
            */agnhost:*) python3 "$E2E_ROOT/e2e/lib/mkimage.py" "$dir/suite-$i.tar" "$name" \
                             --layer "$dir/agnhost" --entrypoint '["/agnhost"]' ;;
            */glibc-dns-testing:*|*/nginx:*) python3 "$E2E_ROOT/e2e/lib/mkimage.py" "$dir/suite-$i.tar" "$name" \
                             --layer "$(driver_rootfs)" --cmd '["sh"]' ;;
        esac
    done
    # what the "any volume data source" test deploys
    local manifests image exe
    manifests=$(go env GOMODCACHE)/k8s.io/kubernetes@$KUBERNETES_VERSION/test/e2e/testing-manifests/storage-csi/any-volume-datasource
    for name in hello-populator volume-data-source-validator; do
        image=$(grep -rhoE "registry\.k8s\.io/sig-storage/$name:[^\" ]+" "$manifests" 2>/dev/null | head -1)
        [ -n "$image" ] || die "the suite's manifests ($manifests) name no $name image"
        exe=$E2E_CACHE/populator-$POPULATOR_VERSION/hello-populator
        [ "$name" = volume-data-source-validator ] && exe=$E2E_CACHE/validator-$VALIDATOR_VERSION/volume-data-source-validator
        rm -rf "${dir:?}/$name"; mkdir -p "$dir/$name"; cp "$exe" "$dir/$name/"
        python3 "$E2E_ROOT/e2e/lib/mkimage.py" "$dir/suite-$name.tar" "$image" \
            --layer "$dir/$name" --entrypoint "[\"/$name\"]"
        names="$names $image"
    done
    log "suite images: $(echo $names)"
}

run_suite() {
    local bin=$E2E_CACHE/suite-$KUBERNETES_VERSION out=$W/suite n
    local flavor=${SUITE_FLAVOR:-central} testdriver=$E2E_ROOT/e2e/testdriver.yaml
    FLAVOR=$flavor
    CONTROLLER_COMPONENT=controller
    set +e
    [ "$flavor" = cluster ] && [ ${#NODES[@]} -gt 1 ] && second_node_up
    NODE_VOLUME_LIMIT=$SUITE_VOLUME_LIMIT
    deploy_flavor "$flavor" || { NODE_VOLUME_LIMIT=""; undeploy_flavor "$flavor"; set -e; return; }
    NODE_VOLUME_LIMIT=""
    for n in $(nodes_up); do
        check_eq "CSINode's volume limit on $n is the node plugin's" "$SUITE_VOLUME_LIMIT" \
            "$(kc get csinode "$n" -o jsonpath='{.spec.drivers[?(@.name=="example.csi.k8s.io")].allocatable.count}')"
    done
    if [ "$(nodes_up | wc -l)" -gt 1 ]; then
        # the tests' pods go wherever the scheduler puts them, not all on
        # the first node
        mkdir -p "$out"
        grep -v '^ClientNodeName:' "$testdriver" >"$out/testdriver.yaml"
        testdriver=$out/testdriver.yaml
    fi
    scenario "Kubernetes' External Storage suite ($KUBERNETES_VERSION, $flavor flavor on $(nodes_up | wc -l) node(s), $SUITE_PROCS processes)"
    kc apply -f "$E2E_ROOT/e2e/manifests/preloaded-images.yaml" >/dev/null \
        || fail "the policy that gives pods pulling Always the imported image"
    mkdir -p "$out"
    local skip start=$SECONDS
    skip=$(suite_skip_patterns | paste -sd'|')
    log "External Storage suite: logs/suite.log (takes long)"
    (cd "$E2E_ROOT" && "$bin/ginkgo" --procs="$SUITE_PROCS" --timeout="$SUITE_TIMEOUT" \
        --focus="$SUITE_FOCUS" ${skip:+--skip="$skip"} --no-color \
        --output-dir="$out" --junit-report=junit.xml --json-report=report.json \
        "$bin/e2e.test" -- \
        -kubeconfig="$W/admin.kubeconfig" -provider=skeleton -repo-root="$E2E_ROOT" \
        -storage.testdriver="$testdriver" -report-dir="$out" \
        -node-os-distro=debian -allowed-not-ready-nodes=0 \
    ) >"$W/logs/suite.log" 2>&1
    local rc=$?
    local took=$((SECONDS - start))
    # Kept with the logs: the work dir goes at teardown.
    cp "$out/report.json" "$out/junit.xml" "$W/logs/" 2>/dev/null
    if python3 "$E2E_ROOT/e2e/lib/suite_summary.py" "$out/report.json" "$took" >"$out/summary.txt"; then
        sed 's/^/  /' "$out/summary.txt"
        cp "$out/summary.txt" "$W/logs/suite-summary.txt"
        local failed passed
        passed=$(sed -n 's/^passed: //p' "$out/summary.txt")
        failed=$(sed -n 's/^failed: //p' "$out/summary.txt")
        check_eq "suite: no test failed ($passed passed in ${took}s)" 0 "$failed"
        check "suite: at least one test ran" test "${passed:-0}" -gt 0
    else
        fail "suite: no report (ginkgo exited $rc; logs/suite.log)"
    fi
    # what the suite left behind
    eventually 300 "suite: no PersistentVolume left" count_is 0 kc get pv -o name
    undeploy_flavor "$flavor"
    set -e
}
