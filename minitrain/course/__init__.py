"""The course machinery: exercises generated from the library, grading, notebook upkeep.

The top layer: it imports the techniques, nothing below imports it. Files by role:

- ``exercises.py``: ``python -m minitrain.exercises build|check|start`` — stubs and solutions
  written from the ``### BEGIN SOLUTION`` markers in the library; the command line, and the
  public face of the three files below (it re-exports their names);
- ``chapters.py``: ``CHAPTERS``, the modules whose marked functions each chapter's exercise
  file holds (edit it when a chapter's exercises move), and ``ROOT``, the course repository;
- ``exercise_regions.py``: the marked functions found in the library (``Exercise``);
- ``exercise_files.py``: exercises/ and solutions/ rendered, built, checked, copied for learners;
- ``patching.py``: a learner's functions put in place of the library's, in this process and
  (through ``minitrain.runtime.add_rank_initializer``) in every rank;
- ``grade.py``: ``python -m minitrain.grade [chapter]`` — the score table;
- ``notebooks.py``: ``python -m minitrain.course.notebooks run`` — re-execute notebooks in place.
"""
