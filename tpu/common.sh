# Shared by the tpu/*.sh scripts (sourced, not run): argument checks, --dry-run printing, and
# what an accelerator type means (hosts per slice, default runtime version).
# shellcheck shell=bash

TPU_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$TPU_DIR/.." && pwd)"
export REPO_ROOT  # for the scripts that pack or call the checkout
SCRIPT="tpu/$(basename "$0")"
DRY_RUN=0  # set by --dry-run; read by run() and note()

die() {
  echo "$SCRIPT: error: $*" >&2
  exit 2
}

need() {  # need VALUE FLAG: a required flag was not given
  [ -n "$1" ] || die "$2 is required (see $SCRIPT --help)"
}

# The flags every script takes. A script's own argument loop handles its own flags and ends in
#   *) common_flag "$@"; shift "$SHIFTED" ;;
# which sets NAME, ZONE, PROJECT or DRY_RUN (SHIFTED: how many words it used), prints the help,
# or stops on an unknown argument. TAKES_COMMAND=1 (run, watch) says the jaxrl command goes
# after -- in that message.
NAME="" ZONE="" PROJECT="" TAKES_COMMAND=0 SHIFTED=0
# shellcheck disable=SC2034  # NAME, ZONE, PROJECT and SHIFTED are read by the sourcing script
common_flag() {
  case $1 in
    --name) NAME=${2-}; SHIFTED=2 ;;
    --zone) ZONE=${2-}; SHIFTED=2 ;;
    --project) PROJECT=${2-}; SHIFTED=2 ;;
    --dry-run) DRY_RUN=1; SHIFTED=1 ;;
    -h | --help) usage; exit 0 ;;
    *)
      local hint=""
      [ "$TAKES_COMMAND" = 0 ] || hint=": the jaxrl command goes after --"
      die "unknown argument '$1'$hint (see $SCRIPT --help)" ;;
  esac
}

# After the argument loop: the TPU VM named, and the gcloud scope flags in SCOPE.
require_target() {
  need "$NAME" --name
  need "$ZONE" --zone
  # shellcheck disable=SC2034  # SCOPE is read by the sourcing script
  mapfile -t SCOPE < <(scope_flags "$ZONE" "$PROJECT")
}

# One word as a shell would need it typed: bare when safe, else single-quoted. Dry-run output
# is therefore copy-pasteable, and the remote --command string survives the remote shell.
quote() {
  local s=$1
  if [[ -n $s && $s =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
    printf '%s' "$s"
  else
    printf "'%s'" "${s//\'/\'\\\'\'}"
  fi
}

quote_all() {
  local out="" w
  for w in "$@"; do out+="${out:+ }$(quote "$w")"; done
  printf '%s' "$out"
}

# Runs a command, or with --dry-run prints it exactly (one line) and runs nothing.
run() {
  if [ "$DRY_RUN" = 1 ]; then
    quote_all "$@"
    echo
  else
    echo "+ $(quote_all "$@")" >&2
    "$@"
  fi
}

note() {  # a comment line: part of the dry-run transcript, on stderr otherwise
  if [ "$DRY_RUN" = 1 ]; then echo "# $*"; else echo "$SCRIPT: $*" >&2; fi
}

# Hosts (TPU VM workers) in a slice. v5e/v6e types count chips (8 per single host, 4 per host
# in larger slices); v2/v3/v4/v5p types count TensorCores (8 per host).
workers_for() {
  local type=$1 gen=${1%-*} n=${1##*-}
  [[ $n =~ ^[0-9]+$ ]] || die "accelerator type '$type' has no size: use e.g. v5litepod-8, v6e-8, v4-32"
  case $gen in
    v5litepod | v5e | v6e) if [ "$n" -le 8 ]; then echo 1; else echo $((n / 4)); fi ;;
    v2 | v3 | v4 | v5p) if [ "$n" -le 8 ]; then echo 1; else echo $((n / 8)); fi ;;
    *) die "unknown accelerator type '$type': use v2-N, v3-N, v4-N, v5p-N, v5litepod-N or v6e-N" ;;
  esac
}

# The TPU VM runtime (software) version Google documents for each generation.
default_version() {
  case ${1%-*} in
    v6e) echo v2-alpha-tpuv6e ;;
    v5litepod | v5e) echo v2-alpha-tpuv5-lite ;;
    v5p) echo v2-alpha-tpuv5 ;;
    v2 | v3 | v4) echo tpu-ubuntu2204-base ;;
    *) die "no default runtime version for '$1': pass --version" ;;
  esac
}

# gcloud flags every command shares.
scope_flags() {  # scope_flags ZONE PROJECT -> words on stdout, one per line
  echo "--zone=$1"
  [ -z "$2" ] || echo "--project=$2"
}
