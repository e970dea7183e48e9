"""scripts/check-layering on fixture trees: the checked-in fixture (one upward
include) must fail naming it; copies of it, each with one change, must pass
or fail as the rule says."""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
CHECKER = os.path.join(HERE, "..", "..", "scripts", "check-layering")
FIXTURE = os.path.join(HERE, "fixture")
UPWARD = 'base/src/a.cpp:4: includes "top/t.h" from top/, a later layer than base/'


def check(root):
    run = subprocess.run([sys.executable, CHECKER, "--root", root], capture_output=True, text=True)
    return run.returncode, run.stdout.splitlines()


class Tree:
    """A scratch copy of the fixture, edited by the test."""

    def __enter__(self):
        self.dir = tempfile.mkdtemp(prefix="layering-")
        self.root = os.path.join(self.dir, "tree")
        shutil.copytree(FIXTURE, self.root)
        return self

    def __exit__(self, *exc):
        shutil.rmtree(self.dir)

    def path(self, name):
        return os.path.join(self.root, name)

    def write(self, name, text):
        os.makedirs(os.path.dirname(self.path(name)), exist_ok=True)
        with open(self.path(name), "w") as f:
            f.write(text)

    def edit(self, name, old, new):
        with open(self.path(name)) as f:
            text = f.read()
        assert old in text, (name, old)
        self.write(name, text.replace(old, new))

    def without_the_upward_include(self):
        self.edit("base/src/a.cpp", '#include "top/t.h"\n', "")
        return self


class CheckLayering(unittest.TestCase):
    def test_the_fixture_fails_naming_its_one_upward_include(self):
        rc, lines = check(FIXTURE)
        self.assertEqual(rc, 1, lines)
        problems = [line for line in lines if not line.startswith("check-layering:")]
        self.assertEqual(problems, [UPWARD])

    def test_the_fixture_without_it_passes(self):
        with Tree() as tree:
            rc, lines = check(tree.without_the_upward_include().root)
            self.assertEqual(rc, 0, lines)
            self.assertIn("check-layering: ok", lines[-1])

    def test_an_upward_link_fails_naming_the_target(self):
        with Tree() as tree:
            tree.without_the_upward_include()
            tree.edit("base/CMakeLists.txt", "add_library(base_lib STATIC src/a.cpp)\n",
                      "add_library(base_lib STATIC src/a.cpp)\ntarget_link_libraries(base_lib PRIVATE\n  middle_lib)\n")
            rc, lines = check(tree.root)
            self.assertEqual(rc, 1)
            self.assertIn("base/CMakeLists.txt:2: base_lib links middle_lib from middle/, a later layer than base/",
                          lines)

    def test_upward_target_expressions_and_source_paths_fail(self):
        with Tree() as tree:
            tree.without_the_upward_include()
            tree.edit("middle/CMakeLists.txt", "target_link_libraries(middle_lib PUBLIC base_lib)\n",
                      "target_link_libraries(middle_lib PUBLIC base_lib)\n"
                      "add_test(NAME t COMMAND $<TARGET_FILE:top_tool>)\n"
                      "target_include_directories(middle_lib PRIVATE ${PROJECT_SOURCE_DIR}/top/include)\n")
            rc, lines = check(tree.root)
            self.assertEqual(rc, 1)
            self.assertIn("middle/CMakeLists.txt:4: names the target top_tool from top/, a later layer than middle/",
                          lines)
            self.assertIn("middle/CMakeLists.txt:5: names the path top/ from top/, a later layer than middle/", lines)

    def test_a_comment_is_not_a_use(self):
        with Tree() as tree:
            tree.without_the_upward_include()
            tree.edit("base/CMakeLists.txt", "add_library(", "# target_link_libraries(base_lib top_tool)\nadd_library(")
            rc, lines = check(tree.root)
            self.assertEqual(rc, 0, lines)

    def test_peers_may_not_use_each_other(self):
        with Tree() as tree:
            tree.without_the_upward_include()
            tree.write("LAYERING", "base\nmiddle top\n")
            rc, lines = check(tree.root)
            self.assertEqual(rc, 1)
            self.assertIn('top/include/top/t.h:2: includes "middle/m.h" from middle/, its peer top/', lines)

    def test_a_relative_include_into_another_folder_counts(self):
        with Tree() as tree:
            tree.without_the_upward_include()
            tree.edit("middle/src/m.cpp", '#include "middle/m.h"\n',
                      '#include "middle/m.h"\n#include "../../top/include/top/t.h"\n')
            rc, lines = check(tree.root)
            self.assertEqual(rc, 1)
            self.assertIn('middle/src/m.cpp:2: includes "../../top/include/top/t.h" from top/, '
                          "a later layer than middle/", lines)

    def test_a_name_in_two_folders_is_ambiguous(self):
        with Tree() as tree:
            tree.without_the_upward_include()
            tree.write("base/include/common.h", "#pragma once\n")
            tree.write("middle/include/common.h", "#pragma once\n")
            tree.edit("top/src/main.cpp", '#include "top/t.h"\n', '#include "top/t.h"\n#include "common.h"\n')
            rc, lines = check(tree.root)
            self.assertEqual(rc, 1)
            self.assertIn('top/src/main.cpp:2: includes "common.h", which is in several folders: base/, middle/',
                          lines)

    def test_a_folder_layering_does_not_place_fails(self):
        with Tree() as tree:
            tree.without_the_upward_include()
            tree.write("extra/x.cpp", "int x;\n")
            rc, lines = check(tree.root)
            self.assertEqual(rc, 1)
            self.assertIn("extra/x.cpp:1: extra/ holds sources but LAYERING does not place it", lines)

    def test_build_trees_and_nested_trees_are_skipped(self):
        with Tree() as tree:
            tree.without_the_upward_include()
            tree.write("build/CMakeCache.txt", "")
            tree.write("build/gen/x.cpp", '#include "top/t.h"\n')
            shutil.copytree(FIXTURE, tree.path("base/fixture"))  # has its own LAYERING and its upward include
            rc, lines = check(tree.root)
            self.assertEqual(rc, 0, lines)

    def test_a_missing_layering_is_a_usage_error(self):
        with Tree() as tree:
            os.remove(tree.path("LAYERING"))
            run = subprocess.run([sys.executable, CHECKER, "--root", tree.root], capture_output=True, text=True)
            self.assertEqual(run.returncode, 2)
            self.assertIn("LAYERING", run.stderr)


if __name__ == "__main__":
    unittest.main()
