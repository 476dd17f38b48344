# shellcheck shell=bash
# Sourced first by the project's scripts: one PATH that finds every tool they
# install or use, and one way to log and to stop.
#
#   SCRIPT_NAME=e2e                 # log and die name it (default: the script file)
#   . scripts/preamble.sh
#
# PATH gains, once each: Go (/usr/local/go/bin) and the tools `go install` puts
# in GOPATH/bin, cargo's bin, and the sbin directories where mkfs, losetup and
# the other system tools live for a non-login root shell.

preamble_path_add() {
    case ":$PATH:" in
        *":$1:"*) ;;
        *) PATH="$PATH:$1" ;;
    esac
}
preamble_path_add /usr/local/go/bin
preamble_path_add "${GOPATH:-$HOME/go}/bin"
preamble_path_add /root/go/bin
preamble_path_add "$HOME/.cargo/bin"
preamble_path_add /usr/sbin
preamble_path_add /sbin
export PATH

SCRIPT_NAME=${SCRIPT_NAME:-$(basename "$0" .sh)}

# log MESSAGE...: one time-stamped line on standard error.
log() { printf '%s %s: %s\n' "$(date +%T)" "$SCRIPT_NAME" "$*" >&2; }
# die MESSAGE...: logs the failure and exits 1.
die() { log "FAIL: $*"; exit 1; }
