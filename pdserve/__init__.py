"""pdserve: disaggregated prefill/decode LLM serving.

One import name, and one layout rule: `pdserve.X.Y` is the file `pdserve/X/Y.py`. Each
subpackage lives in the repository's top-level folder of its name, and `pdserve/X` is a link to
it (`../X`), so installs, type checkers and editors follow plain paths:

    pdserve.gateway       gateway/        HTTP front: OpenAI API, admission queue, SSE streams
    pdserve.prefill_node  prefill_node/   prefill worker process
    pdserve.decode_node   decode_node/    decode (and colocated) worker process
    pdserve.kvtransfer    kvtransfer/     moving KV blocks between processes: wire, leases
    pdserve.kernels       kernels/        attention and layer kernels (C, Triton, torch)
    pdserve.engine        engine/         model, KV cache, scheduler, sampler (both node kinds)
    pdserve.protocol      protocol/       every cross-process message, authentication
    pdserve.bench         bench/          load generator, SLO sweeps, engine and KV benchmarks
    pdserve.cli           cli/            the `pdserve` command
    pdserve.runtime       runtime/        membership and messaging every worker process shares
    pdserve.planner       planner/        `pdserve plan`: cluster sizing from measured step costs
"""

__version__ = "0.1.0"
