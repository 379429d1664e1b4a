"""Where the coordinator's state lives, behind one boundary (:class:`.store.StateStore`).

- :mod:`.store`: the boundary and the embedded SQLite store (``--state``); :mod:`.state_file`
  opens and checks the file.
- :mod:`.etcd_store`: the same boundary on etcd (``--store etcd://...``); :mod:`.etcd_client`
  and :mod:`.etcd_config` talk to etcd and parse its flags.
- :mod:`.records`: the stored form of jobs and members, and back.
- :mod:`.persistence`: the write-behind that coalesces the domain's changes into store writes.

"Add a store": implement :class:`.store.StateStore` in a module here and pass the store contract
tests (the ``any_store`` tests of ``tests/test_etcd_store.py``).
"""
