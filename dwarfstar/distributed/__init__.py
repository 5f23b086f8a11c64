"""Layer pipelines across processes and machines on torch.distributed (and mx.distributed's ring).

Rank 0, the coordinator, holds the tokenizer, sessions, sampling and the first layers; each worker
runs a contiguous layer range and keeps the KV of those layers; the last stage holds the output
head. The coordinator talks to every worker over its own 2-rank gloo link (a star: a worker never
talks to another worker), so a worker that dies breaks only its own link, and one that registers
again gets a fresh one without the other ranks re-forming a group.

Each stage loads only its slice (`options.DistOptions.stage_layers`, which `load_engine` asks): the
backends read and keep only those layers' weights, with the embedding on the coordinator and the head
on the last stage, and its KV cache holds arrays for those layers only.

- `protocol`: the fixed header, the segment records, the token-prefix hash, the activation codec;
- `link`: one coordinator-worker link (gloo side group for headers, gloo or NCCL for the data);
- `mlx_ring`: the same link and registration over the mx.distributed ring backend;
- `membership`: the rendezvous store, registration and its checks, the layer plan;
- `stage`: a worker's loop over its layer range;
- `route`: the coordinator side: admission, forward passes, replay, snapshots, gather and split;
- `state`: `RouteState`, whose remote layers the payload code reads and writes as if local;
- `pipeline`: pipelined prefill; `backend`: `RouteBackend`, the session layer's `Backend`;
- `speculation`: MTP speculative decoding on a route (the coordinator's runner and remote draft
  track); `drafting`: the last stage's MTP draft, next to the final streams it drafts from;
- `options`: what the `--dist-*` flags ask; `launch`: torchrun, mlx.launch or by-hand start of either role.
"""
