"""Reading and folding a job, free of Textual: testable without a terminal.

The client that reads a job's records and streams (:mod:`.client`, :mod:`.follow`), the state
they fold into (:mod:`.state`), the per-rank log rings (:mod:`.logbuffer`,
:mod:`.packed_buffer`, :mod:`.inplace`, :mod:`.dedupe`), earlier attempts (:mod:`.attempts`),
the stack and collective views (:mod:`.stack_view`, :mod:`.collective_view`), the training
metrics (:mod:`.metrics`), saving
(:mod:`.save`) and formatting (:mod:`.formatting`). The CLI and the screens both build on it;
it imports neither.
"""
