"""High availability on etcd: several coordinators, one leads.

- :mod:`.leadership`: the election (an etcd lease) and the fence every write carries.
- :mod:`.replica`: a replica's life: stand by, lead a term, step down.
- :mod:`.router`: a standby's answers (UNAVAILABLE naming the leader).
"""
