package index

// paged is a growable array whose elements never move. Growth adds a page
// instead of copying: an index of millions of nodes would otherwise copy
// hundreds of megabytes while holding a shard's write lock (stalling every
// reader), and would carry up to twice its size in slack capacity.
type paged[T any] struct {
	pages []*[pageSize]T
	n     int
}

const (
	pageBits = 12
	pageSize = 1 << pageBits
)

func (p *paged[T]) at(i uint32) *T { return &p.pages[i>>pageBits][i&(pageSize-1)] }

func (p *paged[T]) len() int { return p.n }

// grow appends a zero element and returns its index.
func (p *paged[T]) grow() uint32 {
	if p.n == len(p.pages)*pageSize {
		p.pages = append(p.pages, new([pageSize]T))
	}
	p.n++
	return uint32(p.n - 1)
}
