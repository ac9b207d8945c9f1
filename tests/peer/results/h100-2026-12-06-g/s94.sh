# s94 (same warm machine, inline command): . tests/gpu/lib.sh; unpack_builds g39c; bench b128k "$G/bench_full" "$C/full" --prompts 2048 --batch 8 --batch-prompt 131072
