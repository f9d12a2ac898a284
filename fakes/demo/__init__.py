"""`make demo` (`python -m fakes.demo`): the whole driver against the embedded fakes, told as a story for people.

kubectl: the API calls a person would make; node: an agent subprocess with its fake kubelet;
report: what gets printed.
"""
