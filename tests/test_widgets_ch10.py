"""The chapter 10 widget: its schedule is the contract's layout written out by hand, its
measured work equals the formula, and the headless widget reacts to every control."""

from minitrain.widgets.ch10_context_parallel import build_cp_widget, compute_cp_view


def test_schedule_and_measured_work():
    view = compute_cp_view(32, 2, "contiguous", causal=True)
    # rank 0 holds chunk 0: step 0 its own block (diagonal), step 1 rank 1's block (future)
    assert view["schedule"][0] == [[(0, 0, True)], []]
    assert view["schedule"][1] == [[(1, 1, True)], [(1, 0, False)]]
    assert view["flops"] == view["formula_flops"] == [4 * 2 * 32 * 16 * 16, 2 * 4 * 2 * 32 * 16 * 16]
    zig = compute_cp_view(32, 2, "zigzag", causal=True)
    # rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert zig["schedule"][0][1] == [(3, 1, False), (3, 2, False)]
    assert zig["balance"] == 1.0 and view["balance"] == 2.0
    full = compute_cp_view(32, 2, "zigzag", causal=False)
    assert all(len(pairs) == 4 for steps in full["schedule"] for pairs in steps)


def test_widget_updates_headlessly():
    box = build_cp_widget(seq_lens=(20, 32), sizes=(2, 4))
    seq, size, (layout, causal), status, image = (box.children[0], box.children[1],
                                                   box.children[2].children, box.children[3],
                                                   box.children[4])
    assert "N = 32, P = 4, contiguous" in status.value and "balance, busiest / idlest rank: 4.00" in status.value
    picture = bytes(image.value)
    layout.value = "zigzag"
    assert "zigzag" in status.value and "rank: 1.00" in status.value
    assert bytes(image.value) != picture
    seq.value = 20  # 20 is not divisible by 2P = 8
    assert "not divisible by 2P = 8" in status.value
    size.value = 2
    assert "N = 20, P = 2, zigzag" in status.value
    causal.value = False
    assert "full attention" in status.value
