"""Records: everything an agent writes to Redis and to disk for others to read.

Worker output (:mod:`.logs`, :mod:`.publisher`), the event stream (:mod:`.events`), the job's
records (:mod:`.job_records`, :mod:`.retention`), replies to stacks and traces
(:mod:`.reply_publisher`), the command stream an agent reads (:mod:`.commands`) and the pages
of a big record (:mod:`.pages`). The lowest room of ``supervision``: it imports none of the
others.
"""
