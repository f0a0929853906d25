# source .gdna/setup.sh  (device, call 1): tilelang, flash-linear-attention, FlashQLA and their small needs into /tmp/site.
# z3-solver, which tilelang imports, comes in call 2 (.gdnb): until then fla's Gated DeltaNet backward is not
# usable and the trainer's probe picks the PyTorch reference.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gdna/w/*.whl \
  && echo "GDN: tilelang, fla-core and flash-qla installed in /tmp/site (z3-solver comes with .gdnb)"
export PYTHONPATH=/tmp/site
# Kernels TileLang compiled on an earlier machine (packed with pack_gdn.sh's cache argument): FlashQLA's kernels take
# about 110 s per head count to compile on a fresh H200 (two head counts for the Qwen3.5 benchmark: 16 and 32, which
# two background processes can compile side by side), and its cache is keyed by source,
# parameters and GPU architecture, so a cache from any Hopper machine serves another.
if [ -f .gdna/tilelang_cache.tgz ]; then
  tar -C "$HOME" -xzf .gdna/tilelang_cache.tgz && echo "GDN: TileLang's kernel cache restored in $HOME/.tilelang"
fi
