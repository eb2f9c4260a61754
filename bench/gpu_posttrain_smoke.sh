#!/usr/bin/env bash
# The post-training stages' first GPU run, small: dags/gpu-recipe.yaml with every training budget cut (a 2M-token
# pretrain without retrieval rows, two 256K-token long-context phases, a few steps of the reward model, SFT, DPO and
# GRPO), to find what breaks on a GPU in reward_model, sft, dpo and grpo, not to measure what they teach.
#
#   bash bench/gpu_posttrain_smoke.sh                      (first call; carry .whl-dag/pack)
#   KEEP_WORK=1 bash bench/gpu_posttrain_smoke.sh          (the next call resumes the run)
#
# RUN_ARGS defaults to "--stage grpo" (every training stage, no eval); the evals can follow with
# RUN_ARGS="--stage eval_sft_short --stage eval_grpo".
set -uo pipefail
cd "$(dirname "$0")/.."
export HYLIGHT_SET="pretrain.train_tokens=2000000
pretrain.retrieval_share=0.0
pretrain.probe_every=0
pretrain.checkpoint_every=50
long_context.phases=[{seq_len: 4096, rope_theta: 1000000.0, tokens: 262144, short: 30, medium: 70, long: 0}, {seq_len: 8192, rope_theta: 2000000.0, tokens: 262144, short: 35, medium: 35, long: 30}]
long_context.retrieval_share=0.0
long_context.probe_every=0
reward_model.max_steps=30
reward_model.eval_every=10
sft_short.max_prompts=300
sft_short.epochs=1
sft_long.max_prompts=100
sft_long.epochs=1
dpo_short.max_prompts=100
dpo_short.max_steps=10
dpo_short.eval_every=5
dpo_long.max_prompts=50
dpo_long.max_steps=5
dpo_long.eval_every=5
grpo.max_prompts=64
grpo.min_prompts=8
grpo.max_steps=5${HYLIGHT_SET:+
$HYLIGHT_SET}"
export RUN_ARGS=${RUN_ARGS:---stage grpo}
exec bash bench/run_gpu_dag.sh
