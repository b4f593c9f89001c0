"""The model side of the engine: what turns a flat batch of tokens into hidden states and logits.

* ``model``: the one decoder every supported family runs (``CausalLM``), its layers and their switches;
* ``attention``: what a step tells attention (``AttentionMetadata``) and the paged attention a layer calls;
* ``rotary`` and ``moe``: the rotary tables and the mixture-of-experts MLP the decoder uses;
* ``tensor_parallel``: how a model splits over ranks (``Shard``) and the collectives its layers make (``Group``;
  the rank processes themselves are ``engine.tensor_parallel_ranks``);
* ``loader``: fills a ``CausalLM`` from a safetensors checkpoint (or a rank's part of it, cut tensor by
  tensor), fusing its q/k/v, gate/up and experts' tensors into the model's own parameters (it changes whenever
  those parameters do, so it lives beside them).

The model's shape comes from ``engine.model_config`` (config.json parsed once); the runner
(``engine.model_runner``) owns the weights and the KV pool and calls ``CausalLM`` each step.
"""
