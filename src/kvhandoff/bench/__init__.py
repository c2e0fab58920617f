"""kvhandoff.bench — the figures of `kvhandoff bench`: the handoff measured in one run against
the machine's memcpy of the same page set and the raw transport moving the same bytes.

`pageset` builds the shared workload (random pages on both sides, the agents' own span plans),
`worker` is the child process (raw transport receiver, or a prefill/decode agent), `runner`
drives the alternating repetitions and summarises them.
"""
