"""Plots, graphviz drawings and widgets for the book.

Book-only: the serving core never imports this package, so ``minisrv`` runs without
matplotlib, graphviz or ipywidgets installed.
"""
