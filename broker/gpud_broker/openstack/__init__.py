"""GPU VMs through OpenStack Nova: which server each worker is, booting, replacing and retiring
them, and (off by default) healing and scaling the pool.

- ``pool``: the decisions, pure (no I/O, the caller passes the time): the server list matched to
  the broker's workers, one action at a time per server, healing and scaling rules.
- ``nova``: python-novaclient and keystoneauth1 behind a small interface: credentials
  (clouds.yaml or OS_* variables), Nova's errors as clear messages, retries with backoff.
- ``userdata``: the cloud-init user data a booted GPU VM gets.
- ``controller``: runs Nova calls on threads of its own and trades with the broker's loop through
  thread-safe queues, so Nova never blocks the loop.

Only ``controller`` and ``nova`` need the extra ``openstack`` (python-novaclient, keystoneauth1),
and they import it only when the broker talks to Nova.
"""
