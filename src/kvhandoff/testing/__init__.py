"""kvhandoff.testing — what tests (yours and ours) use to exercise kvhandoff for real.

Fault injection (a fault-injecting transport wrapper, a session effect filter), a fake clock,
the byte-pattern helpers, a deterministic simulator of the
transfer protocol (`kvhandoff.testing.simulator`: seeded schedules, faults and invariants;
`python -m kvhandoff.testing.simulator --help`), and a hostile peer (`hostile`: a seeded corpus
of bad and forged frames thrown at an agent's or a bootstrap server's surfaces). Product code
never imports this package.
"""
