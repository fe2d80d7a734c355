"""OpenAI's Batch API over the one request path: tenants upload a JSONL file of requests
(`/v1/files`), create a batch of it (`/v1/batches`), and a worker in the gateway process
answers each line as a live request would be answered (`gateway.request_path.answer`, with
the line's surface), without a client, as the engine's background work (after every live
request), shared fairly between tenants, at the plan's batch price. Results go to an output
and an error file in OpenAI's line shape.

    endpoints  which URLs a batch may target: each a surface's parser and its answer()
    lines      one input line checked like a live request (pure; unit tested)
    files      tenants' files on disk (metadata in `tenancy.batches`)
    objects    the File and Batch objects as the API shows them
    worker     the background worker: leases, fair dispatch, resume
    run        one batch as the worker runs it: lines to answer, counts, partial files
    control    what the routes do to a batch: its window's end, a cancel

docs/gateway.md, "Batches and files", says what a client sees.
"""
