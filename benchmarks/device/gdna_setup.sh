# source .gdna/setup.sh  (device, call 1): tilelang, flash-linear-attention, FlashQLA and their small needs into /tmp/site.
# z3-solver, which tilelang imports, comes in call 2 (.gdnb): until then fla's Gated DeltaNet backward is not
# usable and the trainer's probe picks the PyTorch reference.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gdna/w/*.whl \
  && echo "GDN: tilelang, fla-core and flash-qla installed in /tmp/site (z3-solver comes with .gdnb)"
export PYTHONPATH=/tmp/site
