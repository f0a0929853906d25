# source .fa4b/setup.sh  (device, call 2, within 30 s of call 1, on the same warm machine)
if [ -d .fa4a/w ]; then W=.fa4a/w; else W=.fa4b/w; fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $W/*.whl
PART0=.fa4a/cutlass.tar.xz.part00
[ -f "$PART0" ] || PART0=/tmp/fa4/cutlass.tar.xz.part00
if [ -f "$PART0" ]; then
  cat "$PART0" .fa4b/cutlass.tar.xz.part01 .fa4b/cutlass.tar.xz.part02 | tar -C /tmp/site -xJf - && echo "FA4: cutlass DSL unpacked"
else
  echo "FA4: part 1 of the compiler is missing (a fresh machine, or call 1 did not run): flash_attn_cute will be skipped"
fi
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:/tmp/site
python3 -c "import flash_attn.cute, cutlass; print('FA4 imports:', flash_attn.cute.__file__)" || true
