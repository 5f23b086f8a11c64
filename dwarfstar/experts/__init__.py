"""Routed-expert streaming: run a model whose routed experts do not fit in memory (ds4's --ssd-streaming).

Every non-routed weight stays resident; the routed experts, most of the file, live in a cache of
whole experts under a budget and are read from the GGUF with `pread` on a miss.

* `layout`: where each (layer, expert)'s gate, up and down blocks are in the file, and the budget
  arithmetic (a size or the free memory -> a count of whole experts).
* `policy`: which expert leaves the cache: ds4's decayed frequency, LRU, and Belady's offline optimum.
* `store`: the cache itself, its parallel reads and its telemetry.
* `source`: the `ExpertSource` the forward pass reads a layer's experts from.
* `trace`: recorded routing (per token and layer, the chosen ids) and hot-expert profiles.
* `replay`: the store and plain mmap driven by a recorded trace, with no compute (the benchmark).
* `bound`: the best hit rate an online policy can expect on the synthetic skewed trace (the
  independent-reference bound), to set Belady's optimum against.
"""
