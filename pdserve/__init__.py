"""pdserve: disaggregated prefill/decode LLM serving.

One import name. The subpackages live in the repository's top-level folders, mapped here by
pyproject.toml's `package-dir` (an editable install and a wheel both see the same names):

    pdserve.gateway       gateway/        HTTP front: OpenAI API, admission queue, SSE streams
    pdserve.prefill_node  prefill_node/   prefill worker process
    pdserve.decode_node   decode_node/    decode (and colocated) worker process
    pdserve.kvtransfer    kvtransfer/     moving KV blocks between processes: wire, leases
    pdserve.kernels       kernels/        attention and layer kernels (C, Triton, torch)
    pdserve.engine        engine/         model, KV cache, scheduler, sampler (both node kinds)
    pdserve.protocol      protocol/       every cross-process message, authentication
    pdserve.bench         bench/          load generator, SLO sweeps, engine and KV benchmarks
    pdserve.cli           cli/            the `pdserve` command
    pdserve.runtime       pdserve/runtime membership and messaging every worker process shares
"""

__version__ = "0.1.0"
