"""Every relative link in README.md and docs/ leads to a file of the repository, and no
tracked file names a path outside it (a clone must be able to follow every reference).

Usage: check_links.py REPO_ROOT. Exit 1 listing every dead link or outside path."""

import os
import re
import subprocess
import sys

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A path that leaves the clone: the project's shared folder beside it, or a machine's own.
OUTSIDE = re.compile(r"\.\./shared/|/work/(?:shared|main)/")


def markdown_files(root):
    yield os.path.join(root, "README.md")
    for folder, _, names in os.walk(os.path.join(root, "docs")):
        for name in sorted(names):
            if name.endswith(".md"):
                yield os.path.join(folder, name)


def dead_links(root):
    for path in markdown_files(root):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        in_code = False
        for number, line in enumerate(text.splitlines(), 1):
            if line.lstrip().startswith("```"):
                in_code = not in_code
            if in_code:
                continue
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target) or target.startswith("#"):
                    continue  # a web address or an anchor of the same page
                file_part = target.split("#", 1)[0]
                resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part))
                if not resolved.startswith(os.path.abspath(root) + os.sep) or not os.path.exists(resolved):
                    yield "%s:%d: dead link %s" % (os.path.relpath(path, root), number, target)


def outside_paths(root):
    listed = subprocess.run(["git", "-C", root, "ls-files", "-z"], capture_output=True, check=True).stdout
    for name in listed.decode().split("\0"):
        if not name or name == "tests/check_links.py":
            continue
        path = os.path.join(root, name)
        if not os.path.isfile(path) or os.path.islink(path):
            continue
        with open(path, "rb") as f:
            data = f.read()
        if b"\0" in data:
            continue  # binary
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if OUTSIDE.search(line):
                yield "%s:%d: a path outside the repository: %s" % (name, number, line.strip()[:120])


def main():
    root = os.path.abspath(sys.argv[1])
    problems = list(dead_links(root)) + list(outside_paths(root))
    for problem in problems:
        print(problem)
    if problems:
        print("%d problem(s)" % len(problems))
        return 1
    print("every link in README.md and docs/ leads to a file of the repository; no path outside it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
