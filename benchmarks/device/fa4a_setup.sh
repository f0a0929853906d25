# source .fa4a/setup.sh  (device, call 1): pydantic and FlashAttention-4's Python parts on PYTHONPATH, and
# the first part of the CuTe DSL compiler staged in /tmp/fa4: a later call that carries .fa4b finds it
# there (the checkout's .fa4a does not survive a call that carries another folder).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .fa4a/w/*.whl
mkdir -p /tmp/fa4 && cp .fa4a/cutlass.tar.xz.part00 /tmp/fa4/ && echo "FA4: part 1 of the compiler staged in /tmp/fa4"
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site
