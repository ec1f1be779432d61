import jax
import pytest

from light_jax.parallel import mesh as mesh_lib


@pytest.mark.parametrize(
  "nodes,local,expected",
  [
    (2, 4, (2, 4)),
    (-1, 4, (2, 4)),
    (4, -1, (4, 2)),
    (-1, -1, (1, 8)),
    (8, 1, (8, 1)),
    (1, 8, (1, 8)),
  ],
)
def test_resolve_fills_minus_one(nodes, local, expected):
  assert mesh_lib.resolve_mesh_shape(nodes, local, 8) == expected


def test_resolve_both_fill_makes_a_process_a_node():
  assert mesh_lib.resolve_mesh_shape(-1, -1, 8, num_processes=2) == (2, 4)


@pytest.mark.parametrize(
  "nodes,local,message",
  [
    (3, 4, "12 devices, but 8 are available"),
    (-1, 3, "mesh.local=3 does not divide the 8 devices; set mesh.local to one of 1, 2, 4, 8."),
    (3, -1, "mesh.nodes=3 does not divide the 8 devices; set mesh.nodes to one of 1, 2, 4, 8."),
    (0, 8, "positive int or -1"),
  ],
)
def test_resolve_errors_say_what_to_change(nodes, local, message):
  with pytest.raises(mesh_lib.MeshError, match=message):
    mesh_lib.resolve_mesh_shape(nodes, local, 8)


def test_a_benchmark_s_mesh_error_names_its_flags_and_no_fill_it_refuses():
  with pytest.raises(mesh_lib.MeshError) as error:
    mesh_lib.resolve_mesh_shape(2, 4, 1, names=("--nodes", "--local"))
  assert (
    str(error.value)
    == "mesh 2 x 4 = 8 devices, but 1 are available; set --nodes and --local so that their product is 1."
  )


def test_resolve_both_fill_names_the_process_count_when_it_does_not_divide():
  # The user set neither count: the message says the 3 came from the processes, not from mesh.nodes.
  with pytest.raises(mesh_lib.MeshError, match="make each of the 3 processes a node, but 3 does not divide the 8"):
    mesh_lib.resolve_mesh_shape(-1, -1, 8, num_processes=3)


def test_resolve_refuses_a_node_split_over_two_processes():
  """It was found only as the mesh was made: a traceback, exit 1, where a config error is one line and exit 2."""
  with pytest.raises(mesh_lib.MeshError, match=r"mesh.local=8 would put one node's devices in two processes \(4"):
    mesh_lib.resolve_mesh_shape(1, 8, 8, num_processes=2)
  assert mesh_lib.resolve_mesh_shape(4, 2, 8, num_processes=2) == (4, 2)


def test_make_mesh_is_node_major():
  mesh = mesh_lib.make_mesh(2, 4)
  assert mesh.axis_names == ("node", "local")
  assert mesh.devices.shape == (2, 4)
  assert [d.id for d in mesh.devices.flat] == sorted(d.id for d in jax.devices())
