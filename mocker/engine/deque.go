package engine

// deque is a ring-buffer queue of requests (the waiting queue): push at
// either end, pop at the front, remove anywhere (abort).
type deque struct {
	buf  []*seq
	head int
	n    int
}

func (d *deque) len() int { return d.n }

func (d *deque) grow() {
	if d.n < len(d.buf) {
		return
	}
	nb := make([]*seq, max(16, 2*len(d.buf)))
	for i := 0; i < d.n; i++ {
		nb[i] = d.buf[(d.head+i)%len(d.buf)]
	}
	d.buf, d.head = nb, 0
}

func (d *deque) pushBack(s *seq) {
	d.grow()
	d.buf[(d.head+d.n)%len(d.buf)] = s
	d.n++
}

func (d *deque) pushFront(s *seq) {
	d.grow()
	d.head = (d.head - 1 + len(d.buf)) % len(d.buf)
	d.buf[d.head] = s
	d.n++
}

func (d *deque) at(i int) *seq { return d.buf[(d.head+i)%len(d.buf)] }

func (d *deque) popFront() *seq {
	s := d.buf[d.head]
	d.buf[d.head] = nil
	d.head = (d.head + 1) % len(d.buf)
	d.n--
	return s
}

// remove deletes s, keeping the order of the others.
func (d *deque) remove(s *seq) bool {
	for i := 0; i < d.n; i++ {
		if d.at(i) != s {
			continue
		}
		for j := i; j < d.n-1; j++ {
			d.buf[(d.head+j)%len(d.buf)] = d.at(j + 1)
		}
		d.buf[(d.head+d.n-1)%len(d.buf)] = nil
		d.n--
		return true
	}
	return false
}
