"""kvhandoff.testing — what tests (yours and ours) use to exercise kvhandoff for real.

Fault injection (a fault-injecting transport wrapper, a session effect filter), a fake clock,
a real bootstrap server in a thread and the byte-pattern helpers. Product code never imports
this package.
"""
