# qwen3-1.7b: the Megatron model flags of Qwen3-1.7B (config.json of Qwen/Qwen3-1.7B on the Hugging Face hub),
# as tools/convert_qwen2_hf_to_megatron.py writes them into a converted checkpoint's megatron_model_args.sh.
# The example scripts source this file for MODEL=qwen3-1.7b when CHECKPOINT is unset (dry runs and checks);
# TOKENIZER replaces the --tokenizer-model value. tests/cpu/test_example_scripts.py compares MODEL_ARGS
# with the converter's QwenArchitecture.megatron_flags for that config.json.
MODEL_ARGS=(
  --num-layers 28
  --hidden-size 2048
  --ffn-hidden-size 6144
  --num-attention-heads 16
  --group-query-attention
  --num-query-groups 8
  --kv-channels 128
  --normalization RMSNorm
  --norm-epsilon 1e-06
  --swiglu
  --disable-bias-linear
  --qk-layernorm
  --rotary-percent 1.0
  --rotary-base 1000000
  --position-embedding-type rope
  --make-vocab-size-divisible-by 1
  --padded-vocab-size 151936
  --tokenizer-type HuggingFaceTokenizer
  --tokenizer-model Qwen/Qwen3-1.7B
)
