# qwen3-8b: the Megatron model flags of Qwen3-8B (config.json of Qwen/Qwen3-8B on the Hugging Face hub),
# as tools/convert_qwen2_hf_to_megatron.py writes them into a converted checkpoint's megatron_model_args.sh.
# The example scripts source this file for MODEL=qwen3-8b when CHECKPOINT is unset (dry runs and checks);
# TOKENIZER replaces the --tokenizer-model value. tests/cpu/test_example_scripts.py compares MODEL_ARGS
# with the converter's QwenArchitecture.megatron_flags for that config.json.
MODEL_ARGS=(
  --num-layers 36
  --hidden-size 4096
  --ffn-hidden-size 12288
  --num-attention-heads 32
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
  --untie-embeddings-and-output-weights
  --tokenizer-type HuggingFaceTokenizer
  --tokenizer-model Qwen/Qwen3-8B
)
