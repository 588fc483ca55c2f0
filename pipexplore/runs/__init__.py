"""Runs made elsewhere, brought back: what the exported ``torchrun`` script records (:mod:`.record`),
reading it whole (:mod:`.load`), launching node agents from here (:mod:`.launch`)."""
