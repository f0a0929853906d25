# source .fa4a/setup.sh  (device, call 1): pydantic and FlashAttention-4's Python parts on PYTHONPATH;
# the CuTe DSL compiler (cutlass) is completed by .fa4b/setup.sh in the next call.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .fa4a/w/*.whl
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site
