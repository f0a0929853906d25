# source benchmarks/device/trl_setup.sh WHEELS  (device, after FlashAttention-4's setup.sh, which sets PYTHONPATH)
#
# TRL 1.16.0 for benchmarks/peers/peer_trl_gpu.py on a GPU machine without network, from wheels in WHEELS (made here by
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 -d WHEELS trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
#     python3 -m pip download ... -d WHEELS/alt datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18
#     python3 -m pip download ... -d WHEELS/kernels kernels==0.12.1
# ): what TRL's async trainer imports that the image lacks is `datasets` and its `dill` and `multiprocess`.
# datasets 5.2.0 wants pyarrow >= 24; where the image's pyarrow is older, datasets 4.7.0 (pyarrow >= 21) is
# installed instead. `kernels` goes into a folder of its own (KERNELS_SITE), read only by the probe that
# records what TRL's Hub kernel lookup does offline.
W=${1:-.gpu/whl}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/trlsite \
  "$W"/trl-*.whl "$W"/datasets-*.whl "$W"/dill-*.whl "$W"/multiprocess-*.whl
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/trlsite
if ! python3 -c "import datasets" 2>/tmp/trl_setup_datasets.err; then
  echo "TRL setup: datasets 5.2.0 does not import here ($(tail -n1 /tmp/trl_setup_datasets.err)); using 4.7.0"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/trlsite \
    "$W"/alt/*.whl
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kernelsite \
  "$W"/kernels/*.whl
export KERNELS_SITE=/tmp/kernelsite HF_HUB_DISABLE_TELEMETRY=1
python3 -c "import datasets, trl, pyarrow; from trl.experimental.async_grpo import AsyncGRPOTrainer; \
print('TRL setup: trl', trl.__version__, 'datasets', datasets.__version__, 'pyarrow', pyarrow.__version__)"
