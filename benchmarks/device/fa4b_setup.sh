# source .fa4b/setup.sh  (device, call 2, within 30 s of call 1 so that .fa4a is still there)
if [ -d .fa4a/w ]; then W=.fa4a/w; else W=.fa4b/w; fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $W/*.whl
if [ -f .fa4a/cutlass.tar.xz.part00 ]; then
  cat .fa4a/cutlass.tar.xz.part00 .fa4b/cutlass.tar.xz.part01 .fa4b/cutlass.tar.xz.part02 | tar -C /tmp/site -xJf - && echo "FA4: cutlass DSL unpacked"
else
  echo "FA4: .fa4a is gone (a fresh machine): flash_attn_cute will be skipped"
fi
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site
python3 -c "import flash_attn.cute, cutlass; print('FA4 imports:', flash_attn.cute.__file__)" || true
