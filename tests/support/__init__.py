"""Support code the tests share: servers on a background loop, processes, scripted
and TLS workers, request helpers and the Kubernetes tools.

The rule: test modules (and conftest.py, which holds only fixtures) import from
tests.support, never from one another; a helper two test modules need lives here.
The benchmarks in benchmarks/ may import it too.
"""
