# Sourced by scripts/sanitize and scripts/fuzz: configures a clang-19 tree
# with sanitizers. Usage: configure_sanitizer_tree TREE SANITIZERS [CMAKE ARGS...]
command -v clang++-19 >/dev/null || { echo "$(basename "$0"): clang++-19 is missing: run scripts/setup" >&2; exit 2; }
if [ -z "${CUDAToolkit_ROOT:-}" ] && [ -d /usr/local/cuda ]; then export CUDAToolkit_ROOT=/usr/local/cuda; fi

configure_sanitizer_tree() {
  local tree="$1" sanitizers="$2"
  shift 2
  cmake -S . -B "$tree" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_C_COMPILER=clang-19 -DCMAKE_CXX_COMPILER=clang++-19 -DLOOM_SANITIZE="$sanitizers" "$@" >/dev/null
}
