#!/usr/bin/env bash
# Separate venv holding kt-kernel 0.7.2 (the baseline of evals/bench_kernel.py), installed --no-deps so it cannot
# replace the project's CPU torch (its metadata pins torch==2.9.1 and pulls triton): the new venv sees the main venv's
# packages through a .pth file, so torch, numpy and the editable kt_serve are shared, not re-downloaded.
# Idempotent. Usage: bash launch/install_kt_kernel.sh [KT_VENV_DIR]   (default .venv-kt; main venv: $KT_SERVE_VENV
# or .venv). Then: .venv-kt/bin/python evals/bench_kernel.py ...
# The kt-kernel wheel also carries CUDA packages (sgl_kernel, deep_gemm, ...); its sgl_kernel shadows the main venv's
# CPU stub in this venv, so use this venv for the kernel benchmark, not for serving.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$here/.venv-kt}"
main="${KT_SERVE_VENV:-$here/.venv}"
wheel="${KT_KERNEL_WHEEL:-kt-kernel==0.7.2}"  # or a path to a downloaded wheel

[ -x "$main/bin/python" ] || { echo "[install_kt] no main venv at $main: run launch/install.sh first" >&2; exit 1; }
main_site="$("$main/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# Same interpreter as the main venv, so the shared compiled packages match its ABI.
main_py="$("$main/bin/python" -c 'import sys; print(sys._base_executable)')"
[ -x "$venv/bin/python" ] || { echo "[install_kt] creating venv $venv"; "$main_py" -m venv "$venv"; }
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# addsitedir (not a bare path line) so the main venv's own .pth files run too (the editable kt_serve install).
echo "import site; site.addsitedir('$main_site')" > "$site/kt_serve_main_venv.pth"

if [ "$("$venv/bin/python" -m pip show kt-kernel 2>/dev/null | sed -n 's/^Version: //p')" != "0.7.2" ]; then
  echo "[install_kt] kt-kernel 0.7.2 (--no-deps)"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps "$wheel"
fi
"$venv/bin/python" -c 'import torch, kt_kernel, kt_serve.kernel.experts
print("[install_kt] ok: kt_kernel", getattr(kt_kernel, "__version__", "?"), "| torch", torch.__version__)'
