"""Actors: the :class:`~._actor.Actor` base class and ``@endpoint``, one live actor in its
worker (``_host``: endpoints, mailbox, how calls run), and the worker half of
``torch.distributed`` across a mesh (``_distributed``)."""
