#!/usr/bin/env bash
# The first three steps of `mdlc run` against a PyTorch replay (tests/torch/train_replay.py): the tiny
# GPT-2 of models/gpt2-tiny.mdl with a train section of its own (warmup over 2 steps, cosine decay
# over 4, clipping at a norm the gradients exceed, weight decay on the 2-D weights only), fp32 on the
# CPU back end, from weights made by `mdlc init`, on packed rows that hold several documents. The
# checkpoints of runs of 1, 2 and 3 steps (each from the start) hold the parameters and AdamW moments
# after steps 1, 2 and 3, and the 3-step run's log.jsonl the learning rate, loss and gradient norm of
# each; PyTorch computes the same from its own autograd, clip_grad_norm_, AdamW and the schedule's
# formula. Skips when /usr/bin/python3 cannot import torch.
set -u
cd "$(dirname "$0")/../.."
py=/usr/bin/python3
if ! why=$("$py" -c 'import torch, numpy' 2>&1); then
  echo "[skip] torch training replay: $py cannot import torch: $(printf '%s\n' "$why" | tail -1)"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

step() { # step NAME COMMAND...: runs the command; on failure prints a [fail] line and stops
  local name=$1; shift
  if ! "$@" >"$tmp/log" 2>&1; then
    echo "[fail] torch training replay: $name failed: $(tail -3 "$tmp/log" | tr '\n' ' ')"
    exit 1
  fi
}

# The train section, written into the model and handed to the replay.
B=2 T=16 lr=1e-2 beta1=0.9 beta2=0.95 eps=1e-5 wd=0.1 warmup=2 min_lr=1e-3 steps=4 clip=1.0
no_decay=('*_b' 'ln*' '*.ln*')
no_decay_args=()
for p in "${no_decay[@]}"; do no_decay_args+=(--no-decay "$p"); done
sed '/^train {/,$d' models/gpt2-tiny.mdl >"$tmp/model.mdl"
cat >>"$tmp/model.mdl" <<EOF
train {
    B = $B
    T = $T
    optimizer = adamw(lr=$lr, beta1=$beta1, beta2=$beta2, eps=$eps, weight_decay=$wd)
    no_decay = [$(printf '"%s", ' "${no_decay[@]}" | sed 's/, $//')]
    schedule = cosine(warmup=$warmup, min_lr=$min_lr, steps=$steps)
    clip = $clip
    precision = fp32
    checkpoint = none
}
EOF

# Documents of 9 to 42 bytes, so that each row of 16 tokens holds a document boundary or two.
mkdir -p "$tmp/corpus"
for i in $(seq 10 21); do head -c $((60 * i)) /usr/share/common-licenses/GPL-3 | tail -c $((3 * i - 21)) >"$tmp/corpus/d$i.txt"; done
# (--val-fraction 0.2: val's documents by size hold the 17 tokens a validation row needs)
step "mdlc prep" bin/mdlc prep "$tmp/corpus" -o "$tmp/data" --val-fraction 0.2
step "mdlc init" bin/mdlc init "$tmp/model.mdl" -o "$tmp/W.safetensors" --seed 3
for k in 1 2 3; do
  step "mdlc run --steps $k" bin/mdlc run "$tmp/model.mdl" --data "$tmp/data" --weights "$tmp/W.safetensors" \
    --steps $k --backend cpu --precision fp32 --val-every 0 --val-batches 1 --no-shuffle --out "$tmp/run$k"
done
"$py" tests/torch/train_replay.py "$tmp/data/train_000000.bin" "$tmp/W.safetensors" "$tmp/run3/log.jsonl" \
  "$tmp"/run{1,2,3}/checkpoint.safetensors --B $B --T $T --heads 4 --lr $lr --beta1 $beta1 --beta2 $beta2 \
  --eps $eps --weight_decay $wd --warmup $warmup --min_lr $min_lr --steps $steps --clip $clip \
  "${no_decay_args[@]}"
