"""Layer pipelines across processes and machines on torch.distributed.

Rank 0, the coordinator, holds the tokenizer, sessions, sampling and the first layers; each worker
owns a contiguous layer range and the KV state of those layers only; the last stage holds the output
head. The coordinator talks to every worker over its own 2-rank gloo link (a star: a worker never
talks to another worker), so a worker that dies breaks only its own link, and one that registers
again gets a fresh one without the other ranks re-forming a group.

- `protocol`: the fixed header, the segment records, the token-prefix hash, the activation codec;
- `link`: one coordinator-worker link (gloo side group for headers, gloo or NCCL for the data);
- `membership`: the rendezvous store, registration and its checks, the layer plan;
- `stage`: a worker's loop over its layer range;
- `route`: the coordinator side, a session-layer `Backend`, and `RouteState`, whose remote layers
  are gathered into, and split out of, the normal DSV4 payload;
- `launch`: torchrun or by-hand start of either role.
"""
